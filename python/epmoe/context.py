"""Context: one per EP group and device, created collectively by create_context().

Holds the C++ context's id (what the ops take), its group, config and memory plan. Ops look up
shape facts for their fake kernels here by id, so tracing needs no call into C++.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from typing import Optional

import torch

from ._lib import ops
from .config import Config
from .plan import MemoryPlan, plan_memory


@dataclasses.dataclass(frozen=True)
class _Info:
    """Per-context facts the fake kernels and checks need (read once at creation)."""

    capacity_rows: int
    layout_elems: int  # int32 elements of a layered layout tensor
    offsets_index: int
    rows_index: int
    local_experts: int
    rank: int
    ep_size: int
    device: torch.device
    config: Config
    # derived, for the per-call checks
    max_tokens: int = 0
    hidden: int = 0
    top_k: int = 0
    w13_shape: tuple = ()
    w2_shape: tuple = ()
    keyset: object = None  # dispatch key set of the device kernel (eager no-grad fast path)


def _make_info(capacity, layout_elems, offsets_index, rows_index, E, rank, size, device, config) -> _Info:
    c = config
    key = torch._C.DispatchKey.CUDA if device.type == "cuda" else torch._C.DispatchKey.CPU
    return _Info(capacity, layout_elems, offsets_index, rows_index, E, rank, size, device, c,
                 c.max_num_local_input_tokens, c.hidden_dim, c.top_k,
                 (E, 2 * c.intermediate_dim, c.hidden_dim), (E, c.hidden_dim, c.intermediate_dim),
                 torch._C.DispatchKeySet(key))


_INFO: dict[int, _Info] = {}


def info(context_id: int) -> _Info:
    try:
        return _INFO[context_id]
    except KeyError:
        raise ValueError(f"context: expected an open context, got id {context_id} (closed or unknown)") from None


class Context:
    """A live context. Create with create_context(); close() when done (collective)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("use create_context()")

    @classmethod
    def _make(cls, cid: int, group, config: Config, device: torch.device, plan: MemoryPlan) -> "Context":
        self = object.__new__(cls)
        self.id = cid
        self.group = group
        self.config = config
        self.device = device
        self.memory_plan = plan
        self._slot = 0
        self._closed = False
        self._info = info(cid)
        return self

    # ---- Dist-MoE-shaped properties ----
    @property
    def max_num_local_input_tokens(self) -> int:
        return self.config.max_num_local_input_tokens

    @property
    def hidden_dim(self) -> int:
        return self.config.hidden_dim

    @property
    def top_k(self) -> int:
        return self.config.top_k

    @property
    def context_id(self) -> int:
        return self.id

    @property
    def rank(self) -> int:
        return info(self.id).rank

    @property
    def ep_size(self) -> int:
        return info(self.id).ep_size

    @property
    def num_local_experts(self) -> int:
        return info(self.id).local_experts

    @property
    def capacity_rows(self) -> int:
        return info(self.id).capacity_rows

    @property
    def closed(self) -> bool:
        return self._closed

    def select_activation_slot(self, activation_slot: int, num_moe_layers_in_slot: Optional[int] = None) -> None:
        """Slot that later training forwards save into (pipeline micro-batches use one each)."""
        n = self.config.num_activation_slots
        if not isinstance(activation_slot, int) or not 0 <= activation_slot < n:
            raise ValueError(f"activation_slot: expected an int in [0, {n}), got {activation_slot!r}")
        L = self.config.max_moe_layers_per_activation_slot
        if num_moe_layers_in_slot is not None and not 0 < num_moe_layers_in_slot <= L:
            raise ValueError(f"num_moe_layers_in_slot: expected an int in [1, {L}], got {num_moe_layers_in_slot!r}")
        self._slot = activation_slot

    def check(self) -> None:
        """Raises the error a past call recorded on the device (capacity overflow, bad ids, NaN
        input), synchronising with the device; clears it. The context stays usable."""
        self._require_open()
        ops._context_check(self.id)

    def close(self) -> None:
        """Collective; synchronises and releases every buffer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _INFO.pop(self.id, None)
        ops._context_close(self.id)

    def _require_open(self) -> None:
        if self._closed:
            raise ValueError("context: expected an open context, got a closed one")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"rank {self.rank}/{self.ep_size}"
        return f"epmoe.Context(id={self.id}, {state}, device={self.device})"


def _resolve_device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available() and ops._cuda_device_count() > 0:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu or cuda, got {device}")
    return device


def _group_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _broadcast_text(text: Optional[str], group, device: torch.device, size: int = 512) -> str:
    """Rank 0's string to every rank of the group (bytes in a tensor: object collectives would
    need numpy)."""
    import torch.distributed as dist

    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    if text is not None:
        data = text.encode()
        if len(data) >= size:
            raise ValueError(f"text: expected fewer than {size} bytes, got {len(data)}")
        buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()


def _gather_text(text: str, group, device: torch.device, size: int = 256) -> list[str]:
    import torch.distributed as dist

    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    data = text.encode()[:size - 1]
    buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buf, group=group)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in out]


def _shm_session(group, rank: int) -> str:
    """Rank 0 names the session; the name travels over the group (gloo on CPU)."""
    cpu = torch.device("cpu")
    name = _broadcast_text(f"{os.getpid()}-{uuid.uuid4().hex[:16]}" if rank == 0 else None, group, cpu)
    hosts = _gather_text(socket.gethostname(), group, cpu)
    if len(set(hosts)) != 1:
        raise RuntimeError(f"group: expected every CPU rank on one host (shared memory), got hosts {hosts}")
    return name


def _nccl_session(group, rank: int, device: torch.device) -> str:
    """Rank 0 makes the NCCL unique id; it travels over the group (nccl) as hex."""
    return _broadcast_text(ops._nccl_unique_id() if rank == 0 else None, group, device)


def create_context(group=None, config: Config = None, device=None) -> Context:
    """Collective over `group` (a torch.distributed ProcessGroup; None: one rank).

    CPU: one rank runs in-process; several ranks are processes of one host sharing memory
    (bootstrap through the group, e.g. gloo under torchrun). CUDA: one GPU per rank; several
    ranks use the NCCL transport where epmoe was built with it (unique id sent over the group).
    """
    if not isinstance(config, Config):
        raise TypeError(f"config: expected epmoe.Config, got {type(config).__name__}")
    device = _resolve_device(device)
    rank, size = _group_rank_size(group)
    config.local_experts(size)
    plan = plan_memory(config, size)
    session = ""
    if device.type == "cpu":
        transport = "local" if size == 1 else "shm"
        if size > 1:
            session = _shm_session(group, rank)
    else:
        if ops._cuda_device_count() == 0:
            raise RuntimeError("device: expected a CUDA device epmoe can use, got none "
                               "(no GPU, or epmoe built without CUDA)")
        transport = "cuda"
        if size > 1:
            if not ops._has_nccl():
                raise NotImplementedError(
                    "create_context: a CUDA context over several ranks needs the NCCL transport "
                    "(epmoe_nccl), which this build of epmoe does not have; use one GPU per context "
                    "or CPU ranks")
            transport = "nccl"
            session = _nccl_session(group, rank, device)
    cid = ops._context_create(config.to_native(), transport, session, rank, size, device)
    capacity, layout_elems, offsets_index, rows_index, local_experts, crank, csize = ops._context_info(cid)
    _INFO[cid] = _make_info(capacity, layout_elems, offsets_index, rows_index, local_experts, crank,
                            csize, device, config)
    return Context._make(cid, group, config, device, plan)
