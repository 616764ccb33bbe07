"""ctypes binding of epmoe's C ABI (include/epmoe/c_api.h) for the benchmarks: torch tensors in,
raw device pointers out. The PyTorch op binding of the package is separate (python/epmoe)."""
import ctypes
import os

import torch


class Config(ctypes.Structure):
    _fields_ = [
        ("max_tokens_per_rank", ctypes.c_int64), ("hidden_dim", ctypes.c_int64),
        ("intermediate_dim", ctypes.c_int64), ("top_k", ctypes.c_int32),
        ("num_experts", ctypes.c_int32), ("activation", ctypes.c_int32),
        ("alpha", ctypes.c_float), ("limit", ctypes.c_float), ("capacity_factor", ctypes.c_double),
        ("num_slots", ctypes.c_int32), ("layers_per_slot", ctypes.c_int32),
        ("fuse_epilogues", ctypes.c_int32), ("check_inputs", ctypes.c_int32),
        ("wgrad_f32", ctypes.c_int32), ("barrier_timeout_ms", ctypes.c_int32),
        ("arrival_gated_w13", ctypes.c_int32),
        ("scratch_device_bytes", ctypes.c_int64),  # -1: all scratch in device memory
        ("combine", ctypes.c_int32),  # 0: per_route, 1: per_rank
    ]


class Saved(ctypes.Structure):
    _fields_ = [("slot", ctypes.c_int32), ("layer", ctypes.c_int32), ("step", ctypes.c_int64),
                ("tokens", ctypes.c_int64)]


class ForwardArgs(ctypes.Structure):
    _fields_ = [
        ("x_TD", ctypes.c_void_p), ("tokens", ctypes.c_int64), ("num_tokens_1", ctypes.c_void_p),
        ("topk_ids_TK", ctypes.c_void_p), ("ids_int64", ctypes.c_int32),
        ("topk_scores_TK", ctypes.c_void_p), ("scores_bf16", ctypes.c_int32),
        ("w13_EFD", ctypes.c_void_p), ("w2_EDF", ctypes.c_void_p), ("y_TD", ctypes.c_void_p),
        ("save_for_backward", ctypes.c_int32), ("slot", ctypes.c_int32), ("stream", ctypes.c_void_p),
    ]


class BackwardArgs(ctypes.Structure):
    _fields_ = [
        ("saved", Saved), ("grad_y_TD", ctypes.c_void_p), ("num_tokens_1", ctypes.c_void_p),
        ("topk_ids_TK", ctypes.c_void_p), ("ids_int64", ctypes.c_int32),
        ("topk_scores_TK", ctypes.c_void_p), ("scores_bf16", ctypes.c_int32),
        ("w13_EFD", ctypes.c_void_p), ("w2_EDF", ctypes.c_void_p),
        ("grad_x_TD", ctypes.c_void_p), ("grad_scores_TK", ctypes.c_void_p),
        ("grad_w13_EFD", ctypes.c_void_p), ("grad_w2_EDF", ctypes.c_void_p),
        ("accumulate_wgrad", ctypes.c_int32), ("stream", ctypes.c_void_p),
    ]


def load(path=None):
    path = path or os.environ.get("EPMOE_LIB", "build/src/libepmoe.so")
    lib = ctypes.CDLL(path)
    lib.epmoe_last_error.restype = ctypes.c_char_p
    lib.epmoe_config_default.restype = Config
    lib.epmoe_config_default.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int32, ctypes.c_int32]
    lib.epmoe_context_create_single_gpu.argtypes = [ctypes.POINTER(Config), ctypes.c_int,
                                                    ctypes.POINTER(ctypes.c_void_p)]
    lib.epmoe_context_destroy.argtypes = [ctypes.c_void_p]
    lib.epmoe_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(ForwardArgs), ctypes.POINTER(Saved)]
    lib.epmoe_backward.argtypes = [ctypes.c_void_p, ctypes.POINTER(BackwardArgs)]
    lib.epmoe_check.argtypes = [ctypes.c_void_p]
    lib.epmoe_set_stage_timing.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.epmoe_stage_times.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p),
                                      ctypes.POINTER(ctypes.c_double), ctypes.c_int,
                                      ctypes.POINTER(ctypes.c_int)]
    lib.epmoe_explain_plan.argtypes = [ctypes.POINTER(Config), ctypes.c_int, ctypes.c_char_p,
                                       ctypes.c_size_t]
    return lib


NCCL_UNIQUE_ID_BYTES = 128  # EPMOE_NCCL_UNIQUE_ID_BYTES of include/epmoe/c_api_nccl.h


def load_nccl(path=None):
    """libepmoe_nccl (include/epmoe/c_api_nccl.h); load libepmoe first (its errors, handles)."""
    path = path or os.environ.get("EPMOE_NCCL_LIB", "build/src/cuda/comm/libepmoe_nccl.so")
    nccl = ctypes.CDLL(path)
    nccl.epmoe_nccl_unique_id.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    nccl.epmoe_context_create_nccl.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p,
                                               ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    nccl.epmoe_nccl_peer_access.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    return nccl


def nccl_unique_id(lib, nccl):
    """A fresh NCCL unique id (bytes) for epmoe_context_create_nccl on every rank."""
    buf = ctypes.create_string_buffer(NCCL_UNIQUE_ID_BYTES)
    if nccl.epmoe_nccl_unique_id(buf, NCCL_UNIQUE_ID_BYTES) != 0:
        raise RuntimeError(lib.epmoe_last_error().decode())
    return buf.raw


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class Context:
    """EP = 1 context on cuda:device; Context.create_nccl for one rank of EP over the NCCL transport."""

    def __init__(self, lib, config: Config, device: int = 0, nccl=None):
        self.lib = lib
        self.config = config
        self.nccl_lib = nccl
        self.handle = ctypes.c_void_p()
        if nccl is None:
            self._ok(lib.epmoe_context_create_single_gpu(ctypes.byref(config), device,
                                                         ctypes.byref(self.handle)))

    @classmethod
    def create_nccl(cls, lib, nccl, config: Config, unique_id: bytes, rank: int, size: int, device: int):
        """Collective over the size ranks, each with the same unique_id and config."""
        self = cls(lib, config, device, nccl)
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id: expected {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        self._ok(nccl.epmoe_context_create_nccl(ctypes.byref(config), unique_id, len(unique_id),
                                                rank, size, device, ctypes.byref(self.handle)))
        return self

    def peer_access(self):
        """"nccl-lsa" or "cuda-ipc (<reason>)" for an NCCL context, else None."""
        if self.nccl_lib is None:
            return None
        buf = ctypes.create_string_buffer(256)
        self._ok(self.nccl_lib.epmoe_nccl_peer_access(self.handle, buf, len(buf)))
        return buf.value.decode()

    def _ok(self, rc):
        if rc != 0:
            raise RuntimeError(self.lib.epmoe_last_error().decode())

    def close(self):
        if self.handle:
            self.lib.epmoe_context_destroy(self.handle)
            self.handle = ctypes.c_void_p()

    def forward(self, x, ids, scores, w13, w2, y, save=True, num_tokens=None):
        a = ForwardArgs(_ptr(x), x.shape[0], _ptr(num_tokens), _ptr(ids),
                        int(ids.dtype == torch.int64), _ptr(scores),
                        int(scores.dtype == torch.bfloat16), _ptr(w13), _ptr(w2), _ptr(y),
                        int(save), 0, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        saved = Saved()
        self._ok(self.lib.epmoe_forward(self.handle, ctypes.byref(a), ctypes.byref(saved)))
        return saved

    def backward(self, saved, grad_y, ids, scores, w13, w2, grad_x, grad_scores, grad_w13, grad_w2,
                 num_tokens=None, accumulate=False):
        a = BackwardArgs(saved, _ptr(grad_y), _ptr(num_tokens), _ptr(ids),
                         int(ids.dtype == torch.int64), _ptr(scores),
                         int(scores.dtype == torch.bfloat16), _ptr(w13), _ptr(w2), _ptr(grad_x),
                         _ptr(grad_scores), _ptr(grad_w13), _ptr(grad_w2), int(accumulate),
                         ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        self._ok(self.lib.epmoe_backward(self.handle, ctypes.byref(a)))

    def check(self):
        self._ok(self.lib.epmoe_check(self.handle))

    def stage_timing(self, on):
        self._ok(self.lib.epmoe_set_stage_timing(self.handle, int(on)))

    def stage_times(self):
        names = (ctypes.c_char_p * 64)()
        ms = (ctypes.c_double * 64)()
        n = ctypes.c_int()
        self._ok(self.lib.epmoe_stage_times(self.handle, names, ms, 64, ctypes.byref(n)))
        return [(names[i].decode(), ms[i]) for i in range(min(n.value, 64))]

    def explain(self, ep_size=1):
        buf = ctypes.create_string_buffer(1 << 16)
        self._ok(self.lib.epmoe_explain_plan(ctypes.byref(self.config), ep_size, buf, len(buf)))
        return buf.value.decode()
