"""routed_experts: the fused entry point (dispatch + expert GEMMs + SwiGLU + combine)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import _checks, _ops  # noqa: F401  (_ops registers fake kernels, autograd and effects)
from .context import Context, info

_BF16 = (torch.bfloat16,)
_IDS = (torch.int32, torch.int64)
_SCORES = (torch.float32, torch.bfloat16)
_COUNT = (torch.int32,)


@dataclasses.dataclass(frozen=True)
class ExecutionOptions:
    """Per-call options. validate_values: check ids range and finite scores / x on the host before
    the call (None: on CPU tensors only; on CUDA it would synchronise, and Context.check() reports
    the same errors from the device status word)."""

    validate_values: Optional[bool] = None


_DEFAULT_OPTIONS = ExecutionOptions()


def expert_weights(name: str, w, E: int, rows: int, cols: int, device) -> torch.Tensor:
    """Accepts [E, rows, cols], or TorchTitan's [E, 2, F, D] for W13 (a zero-copy view)."""
    if isinstance(w, torch.Tensor) and w.dim() == 4 and w.shape[1] == 2:
        w = w.reshape(w.shape[0], w.shape[1] * w.shape[2], w.shape[3])
    _checks.tensor(name, w, _BF16, (E, rows, cols), device)
    return w


def routed_experts(x_TD: torch.Tensor, topk_expert_ids_TK: torch.Tensor, topk_scores_TK: torch.Tensor,
                   w13_weight: torch.Tensor, w2_weight: torch.Tensor, context: Context, *,
                   num_tokens: Optional[torch.Tensor] = None,
                   options: Optional[ExecutionOptions] = None) -> torch.Tensor:
    """y_TD[t] = sum_k score[t,k] * W2_e(SwiGLU(W13_e x_t)), e = ids[t,k] (global id; -1 inactive).

    Collective over context.group: every rank calls it in the same order with the same T'.
    x_TD bf16 [T', D] (T' <= Config.max_num_local_input_tokens); ids int32/int64 [T', K]; scores
    fp32/bf16 [T', K]; w13 bf16 [E, 2F, D] (or [E, 2, F, D]); w2 bf16 [E, D, F]; num_tokens int32
    [1] on the device (live rows; None: all). Differentiable in x, scores, w13 and w2.
    """
    if not isinstance(context, Context):
        raise TypeError(f"context: expected epmoe.Context, got {type(context).__name__}")
    context._require_open()
    i = info(context.id)
    cfg = i.config
    dev = i.device
    T = _checks.rows("x_TD", x_TD, cfg.max_num_local_input_tokens)
    D, F, K = cfg.hidden_dim, cfg.intermediate_dim, cfg.top_k
    _checks.tensor("x_TD", x_TD, _BF16, (T, D), dev)
    _checks.tensor("topk_ids_TK", topk_expert_ids_TK, _IDS, (T, K), dev)
    _checks.tensor("topk_scores_TK", topk_scores_TK, _SCORES, (T, K), dev)
    w13 = expert_weights("w13_weight", w13_weight, i.local_experts, 2 * F, D, dev)
    w2 = expert_weights("w2_weight", w2_weight, i.local_experts, D, F, dev)
    if num_tokens is not None:
        _checks.tensor("num_tokens", num_tokens, _COUNT, (1,), dev)
    opts = options or _DEFAULT_OPTIONS
    check_values = opts.validate_values if opts.validate_values is not None else dev.type == "cpu"
    if check_values and _checks.values_checkable(x_TD, topk_expert_ids_TK, topk_scores_TK):
        _checks.values(topk_expert_ids_TK, topk_scores_TK, x_TD, cfg.num_experts, num_tokens)
    needs_grad = torch.is_grad_enabled() and (
        x_TD.requires_grad or topk_scores_TK.requires_grad or w13.requires_grad or w2.requires_grad)
    if needs_grad and cfg.inference:
        raise RuntimeError("routed_experts: inference contexts do not support autograd "
                           "(an input requires grad; Config.inference=True)")
    return torch.ops.epmoe.routed_experts_fwd(x_TD, topk_expert_ids_TK, topk_scores_TK, w13, w2,
                                              num_tokens, context.id, needs_grad, context._slot)
