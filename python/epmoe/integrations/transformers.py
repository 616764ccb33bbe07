"""A transformers-style expert-parallel strategy for epmoe.

transformers shards MoE layers through style classes registered by name (ALL_PARALLEL_STYLES) and
picked by a model's `ep_plan`; a strategy is a router style plus an experts style (the precedent is
the fused `megamoe_router` / `megamoe_experts` pair: the kernel owns EP, the router passes through).
This module implements that protocol without importing transformers:

  EpmoeRouterParallel   router style: pass-through (global expert ids, raw top-k weights)
  EpmoeExpertsParallel  experts style: validate_param, shard_param (Shard(0) over the EP group),
                        install_forward (one epmoe context per layer shape, created lazily and
                        collectively on the first forward; rows padded to the context's T with
                        id -1), is_supported, close
  STRATEGIES            strategy name -> (router style, experts style), incl. "epmoe"
  resolve_strategy      the `auto` rule
  register_with_transformers  adds the styles and strategy to transformers' registries if present

Experts module contract (transformers' experts classes): parameters `gate_up_proj` [E, 2F, D]
(gate rows, then up rows) and `down_proj` [E, D, F]; forward(hidden_states [T, D],
top_k_index [T, K], top_k_weights [T, K]) -> [T, D], weights applied and summed over K.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import Config, create_context, routed_experts
from . import _common

EP_ALL_REDUCE_MAX_BYTES = 32 << 20  # the `auto` rule's cap on the masked all-reduce payload


class EpmoeRouterParallel:
    """Router style: leaves the router's outputs as they are (epmoe takes global ids and the raw
    weights, and owns the communication)."""

    def shard_param(self, module, param_name, mesh):
        return getattr(module, param_name)

    def validate_param(self, module, param_name, mesh, parameter_name=None):
        return None

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        return args, kwargs

    def transform_output_post_forward(self, module, output, mesh):
        return output

    def install_forward(self, module, mesh=None, **kwargs):
        module._epmoe_router = True
        return module


@dataclasses.dataclass
class _LayerState:
    group: object
    rank: int
    size: int
    context: object = None


class EpmoeExpertsParallel:
    """Experts style: the experts' forward becomes one collective epmoe call over the EP group.

    Options: max_tokens (T of the context: rows per rank and call; None: the first forward's
    maximum over the group), capacity_factor, activation ("swiglu" / "swiglu_clamped" with
    alpha, limit). Stateless per instance; per-layer state lives on the module.
    """

    def __init__(self, max_tokens: Optional[int] = None, capacity_factor: float = 2.0,
                 activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0):
        self.max_tokens = _common.optional_int("max_tokens", max_tokens)
        self.capacity_factor = capacity_factor
        self.activation = activation
        self.alpha = alpha
        self.limit = limit

    # ---- transformers' style protocol ----
    def validate_param(self, module, param_name, mesh, parameter_name=None):
        p = getattr(module, param_name)
        _, size = _common.rank_size(_common.group_of(mesh))
        if p.dim() != 3:
            raise ValueError(f"{param_name}: expected a 3-D expert weight [E, N, X], got shape {list(p.shape)}")
        if p.shape[0] % size != 0:
            raise ValueError(f"{param_name}: expected a number of experts divisible by ep_size {size}, got {p.shape[0]}")

    def shard_param(self, module, param_name, mesh):
        """Shards the full [E, ...] parameter over the EP group with Shard(0), and records the
        global expert count on the module (ids stay global). With a DeviceMesh the parameter
        becomes a DTensor, as transformers' loader expects (a meta parameter becomes a placeholder
        without communication, the loader fills this rank's experts); with a ProcessGroup (or no
        group) it becomes this rank's plain local slice."""
        self.validate_param(module, param_name, mesh)
        full = getattr(module, param_name)
        if not hasattr(module, "_epmoe_num_experts"):
            module._epmoe_num_experts = full.shape[0]
        if _common.is_device_mesh(mesh):
            from torch.distributed.tensor import Shard, distribute_tensor

            src = None if full.is_meta else 0
            sharded = distribute_tensor(full.detach(), mesh, [Shard(0)], src_data_rank=src)
        else:
            rank, size = _common.rank_size(_common.group_of(mesh))
            sharded = _common.expert_shard(full.detach(), rank, size, param_name)
        setattr(module, param_name, torch.nn.Parameter(sharded, requires_grad=full.requires_grad))
        module._is_expert_parallel = True
        module._epmoe_sharded = getattr(module, "_epmoe_sharded", frozenset()) | {param_name}
        return getattr(module, param_name)

    def should_use_local_tensors(self, module) -> bool:
        return True  # the epmoe op takes this rank's experts as plain tensors

    def is_supported(self, module, mesh=None) -> tuple[bool, str]:
        p = module.gate_up_proj
        _, size = _common.rank_size(_common.group_of(mesh))
        return _common.supported(p.device, p.dtype, size)

    def install_forward(self, module, ep_mesh=None, tp_mesh=None):
        """Shards both weights (if not yet) and wraps module.forward."""
        if tp_mesh is not None and _common.rank_size(_common.group_of(tp_mesh))[1] > 1:
            raise NotImplementedError("epmoe strategy: tp_size > 1 (TP-sliced dispatch) is not supported; use ep only")
        group = _common.group_of(ep_mesh)
        rank, size = _common.rank_size(group)
        for name in ("gate_up_proj", "down_proj"):
            if name not in getattr(module, "_epmoe_sharded", ()):
                self.shard_param(module, name, ep_mesh)
        module._epmoe_state = _LayerState(group, rank, size)
        style = self

        def forward(hidden_states, top_k_index, top_k_weights):
            return style._forward(module, hidden_states, top_k_index, top_k_weights)

        module.forward = forward
        return module

    def close(self, module) -> None:
        """Collective: closes the layer's context (teardown hook)."""
        st = getattr(module, "_epmoe_state", None)
        if st is not None and st.context is not None:
            st.context.close()
            st.context = None

    # ---- the wrapped forward ----
    def _context(self, module, tokens: int):
        st = module._epmoe_state
        if st.context is None:
            w13 = _common.local(module.gate_up_proj)
            T = self.max_tokens
            if T is None:
                T = tokens
                if st.size > 1:
                    import torch.distributed as dist

                    # on the weights' device: an nccl group reduces CUDA tensors only
                    t = torch.tensor([tokens], dtype=torch.int64, device=w13.device)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=st.group)
                    T = int(t)
            cfg = Config(max_num_local_input_tokens=T, hidden_dim=w13.shape[2],
                         intermediate_dim=w13.shape[1] // 2, top_k=module._epmoe_top_k,
                         num_experts=module._epmoe_num_experts,
                         device_scratch_capacity_factor=self.capacity_factor,
                         activation=self.activation, swiglu_alpha=self.alpha, swiglu_limit=self.limit)
            st.context = create_context(st.group, cfg, w13.device)
        return st.context

    def _forward(self, module, hidden_states, top_k_index, top_k_weights):
        T = hidden_states.shape[0]
        module._epmoe_top_k = top_k_index.shape[1]
        ctx = self._context(module, T)
        Tm = ctx.max_num_local_input_tokens
        x = _common.pad_rows(hidden_states.to(torch.bfloat16), Tm)
        ids = _common.pad_rows(top_k_index, Tm, value=-1)  # padding rows: inactive routes
        w = _common.pad_rows(top_k_weights, Tm)
        if w.dtype not in (torch.float32, torch.bfloat16):
            w = w.float()
        y = routed_experts(x, ids, w, _common.local(module.gate_up_proj), _common.local(module.down_proj), ctx)
        return y[:T].to(hidden_states.dtype)


def eager_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """ExpertsInterface-style forward over the experts the module holds (EP = 1 fallback)."""
    return _common.eager_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj,
                                 module.down_proj)


# ---- registry -----------------------------------------------------------------------------

PARALLEL_STYLES = {
    "epmoe_router": EpmoeRouterParallel(),
    "epmoe_experts": EpmoeExpertsParallel(),
}

# strategy -> (router style, experts style). "all-reduce" and "all-to-all" name transformers'
# own styles; they are listed so `auto` can answer with them.
STRATEGIES = {
    "epmoe": ("epmoe_router", "epmoe_experts"),
    "all-reduce": ("ep_router", "moe_tp_experts"),
    "all-to-all": (None, "ep_dispatch_experts"),
}


def resolve_strategy(name: str, *, ep_size: int, tp_size: int, tokens: int, hidden_dim: int,
                     device: torch.device, dtype: torch.dtype = torch.bfloat16,
                     ep_all_reduce_max_bytes: Optional[int] = EP_ALL_REDUCE_MAX_BYTES) -> tuple[str, str]:
    """(strategy, reason). `auto`: masked all-reduce when the batch is shared across the EP group
    (ep == tp) and its [T, D] payload fits ep_all_reduce_max_bytes (None: no cap); else epmoe where
    it can run here; else all-to-all token dispatch."""
    if name != "auto":
        if name not in STRATEGIES:
            raise ValueError(f"ep strategy: expected one of {sorted(STRATEGIES) + ['auto']}, got {name!r}")
        return name, "requested"
    payload = tokens * hidden_dim * torch.tensor([], dtype=dtype).element_size()
    if ep_size == tp_size and (ep_all_reduce_max_bytes is None or payload <= ep_all_reduce_max_bytes):
        return "all-reduce", f"shared batch (ep == tp) and a {payload}-byte all-reduce"
    ok, why = _common.supported(torch.device(device), dtype, ep_size)
    if ok:
        return "epmoe", why
    return "all-to-all", f"epmoe cannot run here: {why}"


def register_with_transformers() -> bool:
    """Adds the styles (and the strategy, where the installed transformers has a strategy map) to
    transformers' registries. Returns False when transformers is not importable."""
    try:
        from transformers.distributed import tensor_parallel as tp  # type: ignore
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return False
    styles = getattr(tp, "ALL_PARALLEL_STYLES", None)
    if styles is not None:
        for k, v in PARALLEL_STYLES.items():
            styles[k] = v
    try:
        from transformers.distributed import configuration_utils as cu  # type: ignore

        strategies = getattr(cu, "EXPERTS_DISPATCH_STRATEGIES", None)
        if isinstance(strategies, dict):
            strategies["epmoe"] = "epmoe_experts"
    except Exception:  # noqa: BLE001
        pass
    return True
