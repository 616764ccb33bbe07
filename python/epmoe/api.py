"""routed_experts: the fused entry point (dispatch + expert GEMMs + SwiGLU + combine)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _checks, _ops  # noqa: F401  (_ops registers fake kernels, autograd and effects)
from .context import Context

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


def _check_all(i, x_TD, ids_TK, scores_TK, w13, w2, num_tokens) -> None:
    """Every host check of the arguments; raises the first failure, naming the argument."""
    dev = i.device
    T = _checks.rows("x_TD", x_TD, i.max_tokens)
    _checks.tensor("x_TD", x_TD, _BF16, (T, i.hidden), dev)
    _checks.tensor("topk_ids_TK", ids_TK, _IDS, (T, i.top_k), dev)
    _checks.tensor("topk_scores_TK", scores_TK, _SCORES, (T, i.top_k), dev)
    _checks.tensor("w13_weight", w13, _BF16, i.w13_shape, dev)
    _checks.tensor("w2_weight", w2, _BF16, i.w2_shape, dev)
    if num_tokens is not None:
        _checks.tensor("num_tokens", num_tokens, _COUNT, (1,), dev)


def _needs_grad(x_TD, scores_TK, w13, w2, inference: bool) -> bool:
    needs = torch.is_grad_enabled() and (
        x_TD.requires_grad or scores_TK.requires_grad or w13.requires_grad or w2.requires_grad)
    if needs and inference:
        raise RuntimeError("routed_experts: inference contexts do not support autograd "
                           "(an input requires grad; Config.inference=True)")
    return needs


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
    if type(context) is not Context:
        raise TypeError(f"context: expected epmoe.Context, got {type(context).__name__}")
    if context._closed:
        context._require_open()
    i = context._info
    w13 = w13_weight
    # TorchTitan's [E, 2, F, D]: a zero-copy view as [E, 2F, D]
    if isinstance(w13, torch.Tensor) and w13.dim() == 4 and w13.shape[1] == 2:
        w13 = w13.reshape(w13.shape[0], 2 * w13.shape[2], w13.shape[3])
    args = (x_TD, topk_expert_ids_TK, topk_scores_TK, w13, w2_weight, num_tokens)
    validate = (options or _DEFAULT_OPTIONS).validate_values
    if validate or (validate is None and i.device.type == "cpu"):
        _check_all(i, *args)
        if _checks.values_checkable(x_TD, topk_expert_ids_TK, topk_scores_TK):
            _checks.values(topk_expert_ids_TK, topk_scores_TK, x_TD, i.config.num_experts, num_tokens)
    if not _eager_plain(x_TD):
        # Traced (torch.compile, make_fx, fake modes): the registered op, whose fake kernel and
        # autograd trust shapes checked here.
        _check_all(i, *args)
        needs_grad = _needs_grad(x_TD, topk_scores_TK, w13, w2_weight, i.config.inference)
        return _FWD(*args, context.id, needs_grad, context._slot)
    try:
        # Eager: the C++ side validates every argument before any kernel runs, so the Python
        # checks run only to name what it rejected (TypeError for dtypes, as when traced).
        if _needs_grad(x_TD, topk_scores_TK, w13, w2_weight, i.config.inference):
            # Training: the registered autograd's kernels and formulas through one
            # autograd.Function (cheaper per call than the generic custom-op autograd wrapper).
            return _Fused.apply(*args, context.id, context._slot, i.keyset)
        # No autograd: straight to the device kernel.
        return _REDISPATCH(i.keyset, *args, context.id, False, 0)
    except Exception:
        _check_all(i, *args)
        raise


_FWD = torch.ops.epmoe.routed_experts_fwd.default
_BWD = torch.ops.epmoe.routed_experts_bwd.default
_REDISPATCH = _FWD._handle.redispatch_boxed  # OpOverload.redispatch without its Python frame


class _Fused(torch.autograd.Function):
    """Eager-only twin of the registered autograd of routed_experts_fwd (python/epmoe/_ops.py)."""

    @staticmethod
    def forward(ctx, x_TD, ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1, cid, slot, keyset):
        y_TD = _FWD.redispatch(keyset, x_TD, ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1, cid, True, slot)
        ctx.save_for_backward(ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1)
        ctx.cid, ctx.slot, ctx.keyset = cid, slot, keyset
        return y_TD

    @staticmethod
    def backward(ctx, grad_y_TD):
        ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1 = ctx.saved_tensors
        args = (grad_y_TD.contiguous(), ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1, ctx.cid, ctx.slot)
        if _eager_plain(grad_y_TD):
            gx, gs, gw13, gw2 = _BWD.redispatch(ctx.keyset, *args)
        else:  # a traced backward (compiled autograd) sees the op
            gx, gs, gw13, gw2 = _BWD(*args)
        return gx, None, gs.to(scores_TK.dtype), gw13, gw2, None, None, None, None


def _eager_plain(x) -> bool:
    """Not traced (torch.compile, make_fx, fake or functional modes) and a plain tensor."""
    return type(x) is torch.Tensor and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
