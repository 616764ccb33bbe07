"""TorchTitan-style integration (no torchtitan import).

  EpmoeRoutedExperts    a routed-experts module with TorchTitan's forward signature
                        (x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E,
                        *, padding_mask_T) and weights `w13.weight` [E, 2, F, D], `w2.weight`
                        [E, D, F] (so state dicts, FSDP and optimizers see the usual names)
  EpmoeExpertParallel   a torch ParallelStyle: Shard(0) of both weights over a 1-D EP mesh (or
                        group), as TorchTitan's ExpertParallel does
  EpmoeRuntime          rank-wide: one epmoe context for every EpmoeRoutedExperts of the model
                        parts, sized for tokens per micro-batch; close() when done
  EpmoeTokenDispatcher  the layered path behind TorchTitan's token-dispatcher protocol
                        (wire_meshes, init_buffer, dispatch -> (routed_input, tokens per local
                        expert, metadata), combine(routed_output, metadata, x) -> out)

Padding rows (padding_mask_T true) get expert id -1 and score 0: never dispatched, zero output.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from .. import Config, combine, create_context, dispatch, routed_experts
from . import _common


class GroupedLinear(nn.Module):
    """A bag of per-expert weights (TorchTitan's GroupedLinear holds `weight` the same way)."""

    def __init__(self, *shape: int, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class EpmoeRoutedExperts(nn.Module):
    @dataclasses.dataclass(frozen=True)
    class Config:
        num_experts: int
        hidden_dim: int
        intermediate_dim: int
        top_k: int
        activation: str = "swiglu"
        swiglu_alpha: float = 1.702
        swiglu_limit: float = 7.0

    def __init__(self, config: "EpmoeRoutedExperts.Config", device=None):
        super().__init__()
        c = config
        self.config = c
        self.w13 = GroupedLinear(c.num_experts, 2, c.intermediate_dim, c.hidden_dim, device=device)
        self.w2 = GroupedLinear(c.num_experts, c.hidden_dim, c.intermediate_dim, device=device)
        self.ep_group = None
        self.runtime: Optional[EpmoeRuntime] = None

    def init_weights(self, std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
        with torch.no_grad():
            for w in (self.w13.weight, self.w2.weight):
                w.copy_(torch.randn(w.shape, generator=generator) * std)

    def forward(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E=None,
                *, padding_mask_T=None):
        if self.runtime is None:
            raise RuntimeError("EpmoeRoutedExperts: expected an EpmoeRuntime built after parallelization, got none")
        ctx = self.runtime.context
        ids = topk_expert_ids_TK
        scores = topk_scores_TK
        if padding_mask_T is not None:
            pad = padding_mask_T.unsqueeze(1)
            ids = ids.masked_fill(pad, -1)
            scores = scores.masked_fill(pad, 0)
        T = x_TD.shape[0]
        Tm = ctx.max_num_local_input_tokens
        y = routed_experts(_common.pad_rows(x_TD.to(torch.bfloat16), Tm), _common.pad_rows(ids, Tm, -1),
                           _common.pad_rows(scores, Tm), self.w13.weight, self.w2.weight, ctx)
        return y[:T].to(x_TD.dtype)


class EpmoeExpertParallel(ParallelStyle):
    """parallelize_module(model, ep_mesh, {"moe.experts": EpmoeExpertParallel()}): rank r keeps
    experts [r*E, (r+1)*E) of both weights as plain local parameters."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, EpmoeRoutedExperts):
            raise TypeError(f"module: expected EpmoeRoutedExperts, got {type(module).__name__}")
        group = _common.group_of(device_mesh)
        rank, size = _common.rank_size(group)
        for lin, name in ((module.w13, "w13.weight"), (module.w2, "w2.weight")):
            local = _common.expert_shard(lin.weight.detach(), rank, size, name)
            lin.weight = nn.Parameter(local, requires_grad=lin.weight.requires_grad)
        module.ep_group = group
        return module


class EpmoeRuntime:
    """One context for all EpmoeRoutedExperts in `model_parts` (they must share one shape)."""

    def __init__(self, model_parts: Iterable[nn.Module], device, tokens_per_microbatch: int, *,
                 capacity_factor: float = 2.0, max_layers_in_flight: Optional[int] = None,
                 inference: bool = False):
        layers = [m for part in model_parts for m in part.modules() if isinstance(m, EpmoeRoutedExperts)]
        if not layers:
            raise ValueError("model_parts: expected at least one EpmoeRoutedExperts, got none")
        shapes = {m.config for m in layers}
        if len(shapes) != 1:
            raise ValueError(f"model_parts: expected one routed-experts config, got {len(shapes)}: {shapes}")
        groups = {id(m.ep_group) for m in layers}
        if len(groups) != 1:
            raise ValueError("model_parts: expected every layer parallelized over one EP group")
        c = layers[0].config
        self.config = Config(
            max_num_local_input_tokens=tokens_per_microbatch, hidden_dim=c.hidden_dim,
            intermediate_dim=c.intermediate_dim, top_k=c.top_k, num_experts=c.num_experts,
            max_moe_layers_per_activation_slot=max_layers_in_flight or len(layers),
            device_scratch_capacity_factor=capacity_factor, activation=c.activation,
            swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit, inference=inference)
        self.context = create_context(layers[0].ep_group, self.config, device)
        for m in layers:
            m.runtime = self

    def close(self) -> None:
        self.context.close()


@dataclasses.dataclass
class DispatchMetadata:
    handle: object
    num_tokens: int


class EpmoeTokenDispatcher:
    """TorchTitan's token-dispatcher protocol over epmoe's layered ops. routed_input_RD has the
    context's capacity rows, grouped by local expert; rows past the received count are zero."""

    @dataclasses.dataclass(frozen=True)
    class Config:
        num_experts: int
        top_k: int
        hidden_dim: int
        num_max_tokens_per_rank: int
        capacity_factor: float = 2.0

    def __init__(self, config: "EpmoeTokenDispatcher.Config", device=None):
        self.config = config
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.ep_group = None
        self.context = None

    def wire_meshes(self, ep_mesh) -> None:
        self.ep_group = _common.group_of(ep_mesh)

    def init_buffer(self) -> None:
        """Collective: creates the context that owns the symmetric buffers."""
        c = self.config
        cfg = Config(max_num_local_input_tokens=c.num_max_tokens_per_rank, hidden_dim=c.hidden_dim,
                     intermediate_dim=c.hidden_dim, top_k=c.top_k, num_experts=c.num_experts,
                     device_scratch_capacity_factor=c.capacity_factor)
        self.context = create_context(self.ep_group, cfg, self.device)

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E=None):
        if self.context is None:
            raise RuntimeError("EpmoeTokenDispatcher: expected init_buffer() before dispatch")
        T = x_TD.shape[0]
        Tm = self.context.max_num_local_input_tokens
        recv, handle = dispatch(_common.pad_rows(x_TD, Tm), _common.pad_rows(topk_expert_ids_TK, Tm, -1),
                                _common.pad_rows(topk_scores_TK, Tm), self.context)
        return recv, handle.tokens_per_expert, DispatchMetadata(handle, T)

    def combine(self, routed_output_RD, metadata: DispatchMetadata, x_TD=None):
        y = combine(routed_output_RD.contiguous(), metadata.handle)
        return y[:metadata.num_tokens]

    def close(self) -> None:
        if self.context is not None:
            self.context.close()
            self.context = None
