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
        ("slot_capacity_factor", ctypes.c_double),  # < 0: unset
        ("slot_bytes", ctypes.c_int64),  # < 0: unset (neither: the maximum useful slot)
        ("precision", ctypes.c_int32),  # 0 bf16, 1 fp8_block, 3 nvfp4 (weight-only inference)
        ("inference", ctypes.c_int32),  # 1: forward only (no slots)
        ("prepared_weights", ctypes.c_int32),  # fp8_block: forward takes prepared weights
        ("combine", ctypes.c_int32),  # 0: per_route, 1: per_rank
        ("fp8_wgrad", ctypes.c_int32),  # fp8_block training: 0 fp8, 1 bf16, 2 by_shape (default)
    ]


class SlotPlan(ctypes.Structure):
    """epmoe_slot_plan: the slot terms of plan_memory."""
    _fields_ = [(name, ctypes.c_int64) for name in (
        "minimum_slot_bytes", "balanced_full_save_slot_bytes", "maximum_useful_slot_bytes",
        "slot_bytes", "activation_bytes", "scratch_bytes", "arena_bytes", "total_bytes",
        "device_total_bytes")]


class ContextMemory(ctypes.Structure):
    """epmoe_context_memory: what a context holds for its lifetime."""
    _fields_ = [(name, ctypes.c_int64) for name in (
        "device_bytes", "host_bytes", "device_held_bytes", "host_held_bytes", "other_device_bytes")]


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
        ("w13_q", ctypes.c_void_p), ("w13_scales", ctypes.c_void_p),
        ("w2_q", ctypes.c_void_p), ("w2_scales", ctypes.c_void_p),
        # precision nvfp4: E4M3 block scales and fp32 globals (codes in w13_q / w2_q)
        ("w13_block_scales", ctypes.c_void_p), ("w13_global", ctypes.c_void_p),
        ("w2_block_scales", ctypes.c_void_p), ("w2_global", ctypes.c_void_p),
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
        ("w13_q", ctypes.c_void_p), ("w13_scales", ctypes.c_void_p),
        ("w2_q", ctypes.c_void_p), ("w2_scales", ctypes.c_void_p),
        ("w13_qt", ctypes.c_void_p), ("w13_scales_t", ctypes.c_void_p),
        ("w2_qt", ctypes.c_void_p), ("w2_scales_t", ctypes.c_void_p),
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
    lib.epmoe_context_create_cpu.argtypes = [ctypes.POINTER(Config), ctypes.POINTER(ctypes.c_void_p)]
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
    lib.epmoe_explain_kernels.argtypes = [ctypes.POINTER(Config), ctypes.c_int, ctypes.c_char_p,
                                          ctypes.c_size_t]
    lib.epmoe_plan_slots.argtypes = [ctypes.POINTER(Config), ctypes.c_int, ctypes.POINTER(SlotPlan)]
    lib.epmoe_resolved_fp8_wgrad.argtypes = [ctypes.POINTER(Config), ctypes.c_int,
                                             ctypes.POINTER(ctypes.c_int32)]
    lib.epmoe_context_memory_held.argtypes = [ctypes.c_void_p, ctypes.POINTER(ContextMemory)]
    lib.epmoe_recomputes.argtypes = [ctypes.c_void_p, ctypes.POINTER(Saved),
                                     ctypes.POINTER(ctypes.c_int32)]
    lib.epmoe_slot_peak_bytes.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_int64)]
    lib.epmoe_prepare_weights_fp8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                              ctypes.c_void_p]
    lib.epmoe_prepare_weights_nvfp4.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.epmoe_prepare_weights_mxfp8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_int, ctypes.c_void_p]
    return lib


def plan_slots(lib, config, ep_size=1):
    """SlotPlan of plan_memory(config, ep_size) as a dict."""
    p = SlotPlan()
    if lib.epmoe_plan_slots(ctypes.byref(config), ep_size, ctypes.byref(p)) != 0:
        raise RuntimeError(lib.epmoe_last_error().decode())
    return {name: getattr(p, name) for name, _ in SlotPlan._fields_}


def explain_kernels(lib, config, ep_size=1):
    """The kernel each grouped GEMM runs on the CUDA backend and the rule that chose it, with this
    process's environment overrides (epmoe_explain_kernels; host only)."""
    buf = ctypes.create_string_buffer(16384)
    if lib.epmoe_explain_kernels(ctypes.byref(config), ep_size, buf, len(buf)) != 0:
        raise RuntimeError(lib.epmoe_last_error().decode())
    return buf.value.decode()


FP8_WGRADS = ("fp8", "bf16", "by_shape")  # epmoe_config.fp8_wgrad values 0, 1, 2


def resolved_fp8_wgrad(lib, config, ep_size=1):
    """The planner's choice for config.fp8_wgrad at ep_size (epmoe_resolved_fp8_wgrad): "fp8" or
    "bf16" (by_shape resolved from the shape; the reason is in epmoe_explain_plan's text)."""
    out = ctypes.c_int32(-1)
    if lib.epmoe_resolved_fp8_wgrad(ctypes.byref(config), ep_size, ctypes.byref(out)) != 0:
        raise RuntimeError(lib.epmoe_last_error().decode())
    return FP8_WGRADS[out.value]


class PreparedFp8:
    """fp8_block_fp32 prepared weights of a bf16 [G, N, L] tensor on cuda:device, with their
    transposed copy (qt [G, L, N], scales_t; transposed=True, what a backward reads; None
    otherwise) (epmoe_prepare_weights_fp8; refill() after the bf16 weights change)."""

    def __init__(self, lib, w, device=0, transposed=True):
        G, N, L = w.shape
        self.lib, self.w, self.device = lib, w, device
        B, S = (N + 127) // 128, (L + 127) // 128
        self.q = torch.empty(G, N, L, dtype=torch.uint8, device=w.device)
        self.scales = torch.empty(G, B, S, dtype=torch.float32, device=w.device)
        self.qt = self.scales_t = None
        if transposed:
            self.qt = torch.empty(G, L, N, dtype=torch.uint8, device=w.device)
            self.scales_t = torch.empty(G, S, B, dtype=torch.float32, device=w.device)
        self.refill()

    def refill(self):
        G, N, L = self.w.shape
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if self.lib.epmoe_prepare_weights_fp8(_ptr(self.w), G, N, L, _ptr(self.q), _ptr(self.scales),
                                              _ptr(self.qt), _ptr(self.scales_t), self.device,
                                              stream) != 0:
            raise RuntimeError(self.lib.epmoe_last_error().decode())


class PreparedNvfp4:
    """nvfp4 prepared weights of a bf16 [G, N, L] tensor on cuda:device (packed E2M1 codes
    [G, N, L/2] and E4M3 block scales [G, ceil(L/128), N, 8], both in the GEMM's order, one fp32
    global per group; weight-only inference) (epmoe_prepare_weights_nvfp4; refill() after the
    bf16 weights change)."""

    def __init__(self, lib, w, device=0):
        G, N, L = w.shape
        self.lib, self.w, self.device = lib, w, device
        self.q = torch.empty(G, N, (L + 1) // 2, dtype=torch.uint8, device=w.device)
        self.scales = torch.empty(G, (L + 127) // 128, N, 8, dtype=torch.uint8, device=w.device)
        self.global_scale = torch.empty(G, dtype=torch.float32, device=w.device)
        self.refill()

    def refill(self):
        G, N, L = self.w.shape
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if self.lib.epmoe_prepare_weights_nvfp4(_ptr(self.w), G, N, L, _ptr(self.q),
                                                _ptr(self.scales), _ptr(self.global_scale),
                                                self.device, stream) != 0:
            raise RuntimeError(self.lib.epmoe_last_error().decode())

    def nbytes(self):
        """Bytes of codes, block scales and globals."""
        return self.q.numel() + self.scales.numel() + 4 * self.global_scale.numel()


class PreparedMxfp8:
    """mxfp8 prepared weights of a bf16 [G, N, L] tensor on cuda:device (E4M3 codes [G, N, L],
    E8M0 scales [G, N, L/32]; MXFP8 inference) (epmoe_prepare_weights_mxfp8; refill() after the
    bf16 weights change)."""

    def __init__(self, lib, w, device=0):
        G, N, L = w.shape
        self.lib, self.w, self.device = lib, w, device
        self.q = torch.empty(G, N, L, dtype=torch.uint8, device=w.device)
        self.scales = torch.empty(G, N, (L + 31) // 32, dtype=torch.uint8, device=w.device)
        self.refill()

    def refill(self):
        G, N, L = self.w.shape
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if self.lib.epmoe_prepare_weights_mxfp8(_ptr(self.w), G, N, L, _ptr(self.q),
                                                _ptr(self.scales), self.device, stream) != 0:
            raise RuntimeError(self.lib.epmoe_last_error().decode())

    def nbytes(self):
        """Bytes of codes and scales."""
        return self.q.numel() + self.scales.numel()


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
    """EP = 1 context on cuda:device (device = "cpu": the CPU backend, host tensors);
    Context.create_nccl for one rank of EP over the NCCL transport."""

    def __init__(self, lib, config: Config, device=0, nccl=None):
        self.lib = lib
        self.config = config
        self.nccl_lib = nccl
        self.cpu = device == "cpu"
        self.handle = ctypes.c_void_p()
        if self.cpu:
            self._ok(lib.epmoe_context_create_cpu(ctypes.byref(config), ctypes.byref(self.handle)))
        elif nccl is None:
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

    def _stream(self):
        return None if self.cpu else ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def forward(self, x, ids, scores, w13, w2, y, save=True, num_tokens=None, slot=0, prepared=None):
        """prepared: (w13, w2) PreparedFp8 for a Config with prepared_weights, PreparedNvfp4
        for precision nvfp4, PreparedMxfp8 for precision mxfp8."""
        a = ForwardArgs(_ptr(x), x.shape[0], _ptr(num_tokens), _ptr(ids),
                        int(ids.dtype == torch.int64), _ptr(scores),
                        int(scores.dtype == torch.bfloat16), _ptr(w13), _ptr(w2), _ptr(y),
                        int(save), slot, self._stream())
        if prepared is not None and isinstance(prepared[0], PreparedNvfp4):
            p13, p2 = prepared
            a.w13_q, a.w13_block_scales, a.w13_global = (_ptr(p13.q), _ptr(p13.scales),
                                                         _ptr(p13.global_scale))
            a.w2_q, a.w2_block_scales, a.w2_global = (_ptr(p2.q), _ptr(p2.scales),
                                                      _ptr(p2.global_scale))
        elif prepared is not None and isinstance(prepared[0], PreparedMxfp8):
            p13, p2 = prepared
            a.w13_q, a.w13_block_scales = _ptr(p13.q), _ptr(p13.scales)
            a.w2_q, a.w2_block_scales = _ptr(p2.q), _ptr(p2.scales)
        elif prepared is not None:
            p13, p2 = prepared
            a.w13_q, a.w13_scales = _ptr(p13.q), _ptr(p13.scales)
            a.w2_q, a.w2_scales = _ptr(p2.q), _ptr(p2.scales)
        saved = Saved()
        self._ok(self.lib.epmoe_forward(self.handle, ctypes.byref(a), ctypes.byref(saved)))
        return saved

    def backward(self, saved, grad_y, ids, scores, w13, w2, grad_x, grad_scores, grad_w13, grad_w2,
                 num_tokens=None, accumulate=False, prepared=None):
        """prepared: the forward's (w13, w2) PreparedFp8 for a Config with prepared_weights."""
        a = BackwardArgs(saved, _ptr(grad_y), _ptr(num_tokens), _ptr(ids),
                         int(ids.dtype == torch.int64), _ptr(scores),
                         int(scores.dtype == torch.bfloat16), _ptr(w13), _ptr(w2), _ptr(grad_x),
                         _ptr(grad_scores), _ptr(grad_w13), _ptr(grad_w2), int(accumulate),
                         self._stream())
        if prepared is not None:
            p13, p2 = prepared
            a.w13_q, a.w13_scales = _ptr(p13.q), _ptr(p13.scales)
            a.w2_q, a.w2_scales = _ptr(p2.q), _ptr(p2.scales)
            a.w13_qt, a.w13_scales_t = _ptr(p13.qt), _ptr(p13.scales_t)
            a.w2_qt, a.w2_scales_t = _ptr(p2.qt), _ptr(p2.scales_t)
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

    def memory_held(self):
        """ContextMemory of this context as a dict (arena split and held bytes, the rest)."""
        m = ContextMemory()
        self._ok(self.lib.epmoe_context_memory_held(self.handle, ctypes.byref(m)))
        return {name: getattr(m, name) for name, _ in ContextMemory._fields_}

    def recomputes(self, saved):
        """True when the planner made this saved layer recompute (synchronises)."""
        r = ctypes.c_int32(-1)
        self._ok(self.lib.epmoe_recomputes(self.handle, ctypes.byref(saved), ctypes.byref(r)))
        return bool(r.value)

    def slot_peak_bytes(self, slot=0):
        b = ctypes.c_int64()
        self._ok(self.lib.epmoe_slot_peak_bytes(self.handle, slot, ctypes.byref(b)))
        return b.value

    def explain(self, ep_size=1):
        buf = ctypes.create_string_buffer(1 << 16)
        self._ok(self.lib.epmoe_explain_plan(ctypes.byref(self.config), ep_size, buf, len(buf)))
        return buf.value.decode()
