"""The torch-native FP8 MoE recipe (EP = 1, and EP = R through torch_recipe.moe_forward_ep's
all_to_all dispatch and combine): torch_recipe.moe_forward with both grouped GEMMs on
torch._scaled_grouped_mm, the row-wise float8 recipe torch offers (as torchao's float8 MoE training
runs it): e4m3 operands, fp32 scales, one per row of the grouped activations (quantized at each
call) and one per output channel of each expert's weight (quantized once, as epmoe-fp8 prepares
its weights). A scale is amax / 448 of its row, so x ~= q * scale.

Backward: torch 2.11 registers no derivative for _scaled_grouped_mm (its autograd kernel is the
not-implemented fallback), so ScaledGroupedMm's backward runs the two gradient GEMMs of each grouped
GEMM in bf16 torch._grouped_mm on the bf16 operands, as the bf16 recipe's autograd does.
BACKWARD_GEMMS names this for the result rows."""
import torch

import torch_recipe

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BACKWARD_GEMMS = "bf16 torch._grouped_mm (no autograd formula for torch._scaled_grouped_mm)"


def quantize_rows(a):
    """a [..., K] (any float dtype) -> (e4m3 [..., K], fp32 scale [...]) with a ~= q * scale[..., None];
    all-zero rows (padding) get a tiny scale and zero codes."""
    a = a.detach()
    scale = a.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12).div_(E4M3_MAX)
    q = torch.div(a, scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)  # div: a new fp32 tensor
    return q, scale.squeeze(-1)


def quantize_weights(w_ENK):
    """Expert weights w [E, N, K] (out, in: w13 [E, 2F, D], w2 [E, D, F]) -> the operand
    _scaled_grouped_mm wants for x @ w[e]^T: e4m3 [E, K, N] column-major (the transposed view of
    [E, N, K] codes) and fp32 scales [E, N], one per output channel."""
    q_ENK = torch.empty(w_ENK.shape, dtype=E4M3, device=w_ENK.device)
    scale_EN = torch.empty(w_ENK.shape[:-1], dtype=torch.float32, device=w_ENK.device)
    for e in range(w_ENK.shape[0]):  # one expert at a time: fp32 temporaries of one expert only
        q_ENK[e], scale_EN[e] = quantize_rows(w_ENK[e])
    return q_ENK.transpose(-2, -1), scale_EN


def dequantize(q, scale):
    """float32 q * scale, scale broadcast over the last dim of q (rows) — the CPU twin of the
    scaling _scaled_grouped_mm applies."""
    return q.float() * scale.unsqueeze(-1)


_compiled_quantize_rows = None


def quantize_rows_fused(a):
    """quantize_rows on CUDA as one torch.compile'd kernel (amax, scale, divide, cast fused, as
    torchao's float8 training quantizes); eager on CPU."""
    global _compiled_quantize_rows
    if not a.is_cuda:
        return quantize_rows(a)
    if _compiled_quantize_rows is None:
        _compiled_quantize_rows = torch.compile(quantize_rows)
    return _compiled_quantize_rows(a)


def scaled_grouped_mm(a_MK, wq_EKN, ws_EN, offs):
    """bf16 [M, N]: rows of group e of a (bf16, quantized here per row) times w[e]^T in e4m3."""
    aq_MK, as_M = quantize_rows_fused(a_MK)
    return torch._scaled_grouped_mm(aq_MK, wq_EKN, as_M, ws_EN, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


class ScaledGroupedMm(torch.autograd.Function):
    """y [M, N] = a [M, K] @ w[e]^T per group (w [E, N, K] bf16, wq / ws its prepared e4m3 form):
    forward on torch._scaled_grouped_mm, backward in bf16 torch._grouped_mm (BACKWARD_GEMMS)."""

    mm = staticmethod(scaled_grouped_mm)  # the forward GEMM; a test substitutes a CPU emulation

    @staticmethod
    def forward(ctx, a_MK, w_ENK, wq_EKN, ws_EN, offs):
        ctx.save_for_backward(a_MK, w_ENK, offs)
        return ScaledGroupedMm.mm(a_MK, wq_EKN, ws_EN, offs)

    @staticmethod
    def backward(ctx, g_MN):
        a_MK, w_ENK, offs = ctx.saved_tensors
        g_MN = g_MN.contiguous()
        grad_a = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_a = torch._grouped_mm(g_MN, w_ENK, offs=offs)  # [M, K]
        if ctx.needs_input_grad[1]:
            grad_w = torch._grouped_mm(g_MN.t(), a_MK, offs=offs)  # [E, N, K], groups along M
        return grad_a, grad_w, None, None, None


def experts(xp, offs, w13, w2, prepared, clamped=False):
    """torch_recipe.experts on e4m3: prepared = (quantize_weights(w13), quantize_weights(w2))."""
    (w13q, w13s), (w2q, w2s) = prepared
    h13 = ScaledGroupedMm.apply(xp, w13, w13q, w13s, offs)
    return ScaledGroupedMm.apply(torch_recipe.swiglu(h13, clamped), w2, w2q, w2s, offs)


def moe_forward(x, ids, scores, w13, w2, prepared, clamped=False):
    """torch_recipe.moe_forward with the grouped GEMMs in row-wise fp8 (w13 [E, 2F, D],
    w2 [E, D, F] bf16; prepared: their quantize_weights, refreshed by the caller after updates)."""
    T, K = ids.shape
    E = w13.shape[0]
    order, dst, offs, rows = torch_recipe.permute(ids, E)
    tok = order // K
    xp = x.new_zeros(rows, x.shape[1]).index_copy(0, dst, x[tok])
    out = experts(xp, offs, w13, w2, prepared, clamped)
    return torch_recipe.combine(out[dst], tok, scores.reshape(-1)[order], T)


def moe_forward_ep(x, ids, scores, w13, w2, prepared, group=None, clamped=False):
    """torch_recipe.moe_forward_ep (all_to_all_single dispatch and combine unchanged) with this
    rank's expert GEMMs in row-wise fp8; w13 / w2 this rank's experts, prepared their
    quantize_weights."""
    return torch_recipe.moe_forward_ep(
        x, ids, scores, w13, w2, group, clamped,
        experts_fn=lambda xp, offs: experts(xp, offs, w13, w2, prepared, clamped))


def emulated_scaled_grouped_mm(a_MK, wq_EKN, ws_EN, offs):
    """CPU twin of scaled_grouped_mm (torch._scaled_grouped_mm has no CPU kernel): the same row
    quantization, then fp32 matmuls per group on the dequantized operands, bf16 out. Substituted
    for ScaledGroupedMm.mm by the CPU checks."""
    aq_MK, as_M = quantize_rows(a_MK)
    a_MK = dequantize(aq_MK, as_M)
    w_ENK = dequantize(wq_EKN.transpose(-2, -1), ws_EN)
    y_MN = torch.zeros(a_MK.shape[0], w_ENK.shape[1], device=a_MK.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        y_MN[start:end] = a_MK[start:end] @ w_ENK[e].t()
        start = end
    return y_MN.to(torch.bfloat16)


def unsupported_reason(device="cuda"):
    """None where torch._scaled_grouped_mm runs the row-wise recipe here, else why not (the bench
    then leaves the torch-native-fp8 rows out): a 2-group call on tiny shapes."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        a = torch.randn(32, 32, device=device, dtype=torch.bfloat16)
        w = torch.randn(2, 16, 32, device=device, dtype=torch.bfloat16)
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        wq, ws = quantize_weights(w)
        y = scaled_grouped_mm(a, wq, ws, offs)
        if tuple(y.shape) != (32, 16) or y.dtype != torch.bfloat16:
            return f"torch._scaled_grouped_mm returned {tuple(y.shape)} {y.dtype}, expected (32, 16) bfloat16"
        if y.is_cuda:
            torch.cuda.synchronize()
    except (RuntimeError, TypeError, NotImplementedError, ValueError) as e:
        return f"torch._scaled_grouped_mm (row-wise e4m3, fp32 scales) failed: {e}"
    return None
