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


def _slow_check(name, t, dtypes, shape, device):
    """Names what is wrong; the fast test in routed_experts only says that something is."""
    _checks.tensor(name, t, dtypes, shape, device)


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
    dev = i.device
    T = x_TD.shape[0] if isinstance(x_TD, torch.Tensor) and x_TD.dim() == 2 else -1
    if not 1 <= T <= i.max_tokens:
        _checks.rows("x_TD", x_TD, i.max_tokens)
    w13 = w13_weight
    # TorchTitan's [E, 2, F, D]: a zero-copy view as [E, 2F, D]
    if isinstance(w13, torch.Tensor) and w13.dim() == 4 and w13.shape[1] == 2:
        w13 = w13.reshape(w13.shape[0], 2 * w13.shape[2], w13.shape[3])
    shape_TD, shape_TK = (T, i.hidden), (T, i.top_k)
    checks = ((x_TD, "x_TD", _BF16, shape_TD), (topk_expert_ids_TK, "topk_ids_TK", _IDS, shape_TK),
              (topk_scores_TK, "topk_scores_TK", _SCORES, shape_TK), (w13, "w13_weight", _BF16, i.w13_shape),
              (w2_weight, "w2_weight", _BF16, i.w2_shape))
    for t, name, dtypes, shape in checks:
        if not (isinstance(t, torch.Tensor) and t.dtype in dtypes and t.shape == shape and t.device == dev
                and t.is_contiguous()):
            _slow_check(name, t, dtypes, shape, dev)
    if num_tokens is not None:
        _checks.tensor("num_tokens", num_tokens, _COUNT, (1,), dev)
    opts = options or _DEFAULT_OPTIONS
    check_values = opts.validate_values if opts.validate_values is not None else dev.type == "cpu"
    if check_values and _checks.values_checkable(x_TD, topk_expert_ids_TK, topk_scores_TK):
        _checks.values(topk_expert_ids_TK, topk_scores_TK, x_TD, i.config.num_experts, num_tokens)
    needs_grad = torch.is_grad_enabled() and (
        x_TD.requires_grad or topk_scores_TK.requires_grad or w13.requires_grad or w2_weight.requires_grad)
    if not needs_grad and _eager_plain(x_TD):
        # Eager, no autograd: straight to the device kernel (the registered autograd and effect
        # kernels have nothing to do here); saves the Python autograd round trip per call.
        return _FWD.redispatch(i.keyset, x_TD, topk_expert_ids_TK, topk_scores_TK, w13, w2_weight,
                               num_tokens, context.id, False, 0)
    if needs_grad and i.config.inference:
        raise RuntimeError("routed_experts: inference contexts do not support autograd "
                           "(an input requires grad; Config.inference=True)")
    if needs_grad and _eager_plain(x_TD):
        # Eager training: the same kernels and formulas as the registered autograd, through one
        # autograd.Function (cheaper per call than the generic custom-op autograd wrapper).
        return _Fused.apply(x_TD, topk_expert_ids_TK, topk_scores_TK, w13, w2_weight, num_tokens,
                            context.id, context._slot, i.keyset)
    return _FWD(x_TD, topk_expert_ids_TK, topk_scores_TK, w13, w2_weight, num_tokens, context.id,
                needs_grad, context._slot)


_FWD = torch.ops.epmoe.routed_experts_fwd.default
_BWD = torch.ops.epmoe.routed_experts_bwd.default


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
