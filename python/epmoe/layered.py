"""Layered API: dispatch -> (your expert compute or grouped_gemm) -> combine, each differentiable.

    recv_x_MD, handle = epmoe.dispatch(x_TD, ids_TK, scores_TK, context)
    h_MF = swiglu(epmoe.grouped_gemm(recv_x_MD, w13_EFD, handle))     # rows grouped by expert
    y_TD = epmoe.combine(epmoe.grouped_gemm(h_MF, w2_EDF, handle), handle)

recv_x_MD has context.capacity_rows rows; rows [off[e], off[e+1]) of handle.expert_offsets belong
to local expert e; rows past off[E] are zero and ignored by combine. combine weighs rows with the
scores given to dispatch (include/epmoe/layered.h lists the ordering contract).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import _checks, _ops  # noqa: F401
from .api import ExecutionOptions, _BF16, _COUNT, _IDS, _SCORES
from .context import Context, info


@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """What combine needs from its dispatch (the layout tensor stays on the device)."""

    layout: torch.Tensor  # int32, opaque except for the views below
    topk_ids_TK: torch.Tensor
    topk_scores_TK: torch.Tensor
    context: Context

    @property
    def expert_offsets(self) -> torch.Tensor:
        """int32 [E + 1] on the device: rows of local expert e are [off[e], off[e+1])."""
        i = info(self.context.id)
        return self.layout[i.offsets_index:i.offsets_index + i.local_experts + 1]

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        off = self.expert_offsets
        return off[1:] - off[:-1]


def dispatch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_scores_TK: torch.Tensor,
             context: Context, *, num_tokens: Optional[torch.Tensor] = None,
             options: Optional[ExecutionOptions] = None) -> tuple[torch.Tensor, DispatchHandle]:
    if not isinstance(context, Context):
        raise TypeError(f"context: expected epmoe.Context, got {type(context).__name__}")
    context._require_open()
    i = info(context.id)
    cfg = i.config
    T = _checks.rows("x_TD", x_TD, cfg.max_num_local_input_tokens)
    _checks.tensor("x_TD", x_TD, _BF16, (T, cfg.hidden_dim), i.device)
    _checks.tensor("topk_ids_TK", topk_ids_TK, _IDS, (T, cfg.top_k), i.device)
    _checks.tensor("topk_scores_TK", topk_scores_TK, _SCORES, (T, cfg.top_k), i.device)
    if num_tokens is not None:
        _checks.tensor("num_tokens", num_tokens, _COUNT, (1,), i.device)
    opts = options or ExecutionOptions()
    check_values = opts.validate_values if opts.validate_values is not None else i.device.type == "cpu"
    if check_values and _checks.values_checkable(x_TD, topk_ids_TK, topk_scores_TK):
        _checks.values(topk_ids_TK, topk_scores_TK, x_TD, cfg.num_experts, num_tokens)
    recv_x_MD, layout = torch.ops.epmoe.dispatch(x_TD, topk_ids_TK, topk_scores_TK, num_tokens, context.id)
    return recv_x_MD, DispatchHandle(layout, topk_ids_TK, topk_scores_TK, context)


def grouped_gemm(a_MX: torch.Tensor, w_ENX: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """out[m] = a[m] @ w[e]^T for each row m of local expert e. w: [E, 2F, D] or [E, D, F]."""
    i = info(handle.context.id)
    cfg = i.config
    D, F, E = cfg.hidden_dim, cfg.intermediate_dim, i.local_experts
    if isinstance(w_ENX, torch.Tensor) and w_ENX.dim() == 4 and w_ENX.shape[1] == 2:
        w_ENX = w_ENX.reshape(E, 2 * F, D)
    if not isinstance(w_ENX, torch.Tensor) or w_ENX.dim() != 3:
        raise ValueError(f"w_ENX: expected a 3-D tensor [E, 2F, D] or [E, D, F], got "
                         f"{list(w_ENX.shape) if isinstance(w_ENX, torch.Tensor) else type(w_ENX).__name__}")
    X = D if tuple(w_ENX.shape[1:]) == (2 * F, D) else F
    want = (E, 2 * F, D) if X == D else (E, D, F)
    _checks.tensor("w_ENX", w_ENX, _BF16, want, i.device)
    _checks.tensor("a_MX", a_MX, _BF16, (i.capacity_rows, X), i.device)
    return torch.ops.epmoe.grouped_gemm(a_MX, w_ENX, handle.layout, handle.context.id)


def combine(rows_MD: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """y_TD[t] = sum over active k of score[t,k] * rows_MD[row of (t, k)] (fp32, one rounding)."""
    i = info(handle.context.id)
    _checks.tensor("rows_MD", rows_MD, _BF16, (i.capacity_rows, i.config.hidden_dim), i.device)
    save = torch.is_grad_enabled() and (rows_MD.requires_grad or handle.topk_scores_TK.requires_grad)
    y_TD, _ = torch.ops.epmoe.combine(rows_MD, handle.layout, handle.topk_ids_TK,
                                      handle.topk_scores_TK, handle.context.id, save)
    return y_TD
