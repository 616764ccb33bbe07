"""Fake (meta) kernels, autograd and effects of the TORCH_LIBRARY(epmoe) ops (src/torch).

Every communicating op is registered as an ORDERED effect: torch.compile and make_fx thread a token
through them, so no pass reorders or drops a collective even when its result is unused (its
schema is functional; the context state it touches is the effect). grouped_gemm is a pure
function of its inputs and has no effect.
"""

from __future__ import annotations

import torch
from torch._library.effects import EffectType

from . import context as _context
from ._lib import ops  # noqa: F401  (loads the library)

_NS = "epmoe::"
_EFFECTFUL = ("routed_experts_fwd", "routed_experts_bwd", "dispatch", "combine",
              "combine_backward", "dispatch_backward")


def _wgrad_dtype(context: int) -> torch.dtype:
    dt = _context.info(context).config.wgrad_dtype
    return torch.float32 if dt == torch.float32 else torch.bfloat16


# ---- fused ------------------------------------------------------------------------------------

@torch.library.register_fake(_NS + "routed_experts_fwd")
def _(x_TD, topk_ids_TK, topk_scores_TK, w13_EFD, w2_EDF, num_tokens_1, context, save, slot):
    return torch.empty_like(x_TD)


@torch.library.register_fake(_NS + "routed_experts_bwd")
def _(grad_y_TD, topk_ids_TK, topk_scores_TK, w13_EFD, w2_EDF, num_tokens_1, context, slot):
    wg = _wgrad_dtype(context)
    return (torch.empty_like(grad_y_TD),
            grad_y_TD.new_empty(topk_ids_TK.shape, dtype=torch.float32),
            w13_EFD.new_empty(w13_EFD.shape, dtype=wg),
            w2_EDF.new_empty(w2_EDF.shape, dtype=wg))


def _fused_setup(ctx, inputs, output):
    x_TD, ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1, context, save, slot = inputs
    if not save:
        raise RuntimeError("routed_experts: the forward ran with save=False; it has no backward "
                           "(call through epmoe.routed_experts, which saves when a grad is needed)")
    ctx.save_for_backward(ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1)
    ctx.context = context
    ctx.slot = slot


def _fused_backward(ctx, grad_y_TD):
    ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1 = ctx.saved_tensors
    gx, gs, gw13, gw2 = torch.ops.epmoe.routed_experts_bwd(
        grad_y_TD.contiguous(), ids_TK, scores_TK, w13_EFD, w2_EDF, num_tokens_1, ctx.context, ctx.slot)
    return gx, None, gs.to(scores_TK.dtype), gw13, gw2, None, None, None, None


torch.library.register_autograd(_NS + "routed_experts_fwd", _fused_backward, setup_context=_fused_setup)


# ---- layered ----------------------------------------------------------------------------------

@torch.library.register_fake(_NS + "dispatch")
def _(x_TD, topk_ids_TK, topk_scores_TK, num_tokens_1, context):
    i = _context.info(context)
    return (x_TD.new_empty((i.capacity_rows, x_TD.shape[1])),
            x_TD.new_empty((i.layout_elems,), dtype=torch.int32))


@torch.library.register_fake(_NS + "grouped_gemm")
def _(a_MX, w_ENX, layout, context):
    return a_MX.new_empty((a_MX.shape[0], w_ENX.shape[1]))


@torch.library.register_fake(_NS + "grouped_gemm_backward")
def _(grad_out_MN, a_MX, w_ENX, layout, context):
    return torch.empty_like(a_MX), w_ENX.new_empty(w_ENX.shape, dtype=_wgrad_dtype(context))


@torch.library.register_fake(_NS + "combine")
def _(rows_MD, layout, topk_ids_TK, topk_scores_TK, context, save):
    T, K = topk_ids_TK.shape
    D = rows_MD.shape[1]
    return rows_MD.new_empty((T, D)), rows_MD.new_empty((T, K, D) if save else (0,))


@torch.library.register_fake(_NS + "combine_backward")
def _(grad_y_TD, layout, topk_ids_TK, topk_scores_TK, rows_TKD, context):
    i = _context.info(context)
    return (grad_y_TD.new_empty((i.capacity_rows, grad_y_TD.shape[1])),
            grad_y_TD.new_empty(topk_ids_TK.shape, dtype=torch.float32))


@torch.library.register_fake(_NS + "dispatch_backward")
def _(grad_recv_MD, layout, topk_ids_TK, context):
    return grad_recv_MD.new_empty((topk_ids_TK.shape[0], grad_recv_MD.shape[1]))


def _dispatch_setup(ctx, inputs, output):
    x_TD, ids_TK, scores_TK, num_tokens_1, context = inputs
    ctx.save_for_backward(ids_TK, output[1])
    ctx.context = context
    ctx.mark_non_differentiable(output[1])


def _dispatch_backward(ctx, grad_recv_MD, _grad_layout):
    ids_TK, layout = ctx.saved_tensors
    gx = torch.ops.epmoe.dispatch_backward(grad_recv_MD.contiguous(), layout, ids_TK, ctx.context)
    return gx, None, None, None, None


def _gemm_setup(ctx, inputs, output):
    a_MX, w_ENX, layout, context = inputs
    ctx.save_for_backward(a_MX, w_ENX, layout)
    ctx.context = context


def _gemm_backward(ctx, grad_out_MN):
    a_MX, w_ENX, layout = ctx.saved_tensors
    ga, gw = torch.ops.epmoe.grouped_gemm_backward(grad_out_MN.contiguous(), a_MX, w_ENX, layout, ctx.context)
    return ga, gw, None, None


def _combine_setup(ctx, inputs, output):
    rows_MD, layout, ids_TK, scores_TK, context, save = inputs
    if not save:
        raise RuntimeError("combine: ran with save=False; it has no backward")
    ctx.save_for_backward(layout, ids_TK, scores_TK, output[1])
    ctx.context = context
    ctx.mark_non_differentiable(output[1])


def _combine_backward(ctx, grad_y_TD, _grad_rows):
    layout, ids_TK, scores_TK, rows_TKD = ctx.saved_tensors
    g_rows, g_scores = torch.ops.epmoe.combine_backward(
        grad_y_TD.contiguous(), layout, ids_TK, scores_TK, rows_TKD, ctx.context)
    return g_rows, None, None, g_scores.to(scores_TK.dtype), None, None


torch.library.register_autograd(_NS + "dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd(_NS + "grouped_gemm", _gemm_backward, setup_context=_gemm_setup)
torch.library.register_autograd(_NS + "combine", _combine_backward, setup_context=_combine_setup)

for _name in _EFFECTFUL:
    # Keyed by OpOverload._name ("epmoe::dispatch" for the default overload): pass the overload.
    torch.library._register_effectful_op(getattr(torch.ops.epmoe, _name).default, EffectType.ORDERED)
