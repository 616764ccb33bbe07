"""The torch-native FP8 recipe of the benchmark (bench/torch_recipe_fp8.py) on CPU: the row-wise
e4m3 quantization helpers (shapes, layouts, round trip), the operands against
torch._scaled_grouped_mm's shape checks (meta device), the recipe with its fp8 GEMM emulated
(dequantize, fp32 matmul per group) against the bf16 recipe, and its bf16 backward against torch
autograd through torch._grouped_mm. The real torch._scaled_grouped_mm runs only on CUDA; those
tests skip here."""

import os
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch_recipe  # noqa: E402
import torch_recipe_fp8 as R8  # noqa: E402

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: torch._scaled_grouped_mm has no CPU kernel")


def rel_l2(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_quantize_rows_shapes_and_round_trip():
    g = torch.Generator().manual_seed(0)
    a_MK = torch.randn(40, 64, generator=g) * torch.logspace(-3, 3, 40).unsqueeze(1)
    a_MK[7] = 0  # a padding row
    q_MK, scale_M = R8.quantize_rows(a_MK)
    assert q_MK.dtype == torch.float8_e4m3fn and tuple(q_MK.shape) == (40, 64)
    assert scale_M.dtype == torch.float32 and tuple(scale_M.shape) == (40,)
    live = torch.arange(40) != 7
    # each live row's largest magnitude lands on the largest e4m3 code
    assert torch.equal(q_MK.float().abs().amax(dim=1)[live], torch.full((39,), 448.0))
    assert torch.count_nonzero(q_MK[7].float()) == 0 and torch.isfinite(scale_M[7])
    back_MK = R8.dequantize(q_MK, scale_M)
    # e4m3: 3 mantissa bits (relative step 2^-3, rounding error <= 2^-4); subnormal step 2^-9
    bound = torch.maximum(a_MK.abs() * 2.0 ** -4, 2.0 ** -10 * scale_M.unsqueeze(1)) * 1.001
    assert bool(((back_MK - a_MK).abs() <= bound).all())
    assert rel_l2(back_MK, a_MK) < 0.03


def test_quantize_rows_bf16_input_and_3d():
    g = torch.Generator().manual_seed(1)
    a_BMK = torch.randn(3, 16, 32, generator=g).to(torch.bfloat16)
    q, scale = R8.quantize_rows(a_BMK)
    assert tuple(q.shape) == (3, 16, 32) and tuple(scale.shape) == (3, 16)
    assert rel_l2(R8.dequantize(q, scale), a_BMK.float()) < 0.03
    assert a_BMK.dtype == torch.bfloat16  # the input is left as it was


def test_quantize_weights_layout_scales_and_round_trip():
    E, N, K = 3, 48, 32
    g = torch.Generator().manual_seed(2)
    w_ENK = (torch.randn(E, N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    wq_EKN, ws_EN = R8.quantize_weights(w_ENK)
    assert wq_EKN.dtype == torch.float8_e4m3fn and tuple(wq_EKN.shape) == (E, K, N)
    # column-major in the last two dims, as _scaled_grouped_mm wants its second operand
    assert wq_EKN.stride(-2) == 1 and wq_EKN.stride(-1) == K
    assert ws_EN.dtype == torch.float32 and tuple(ws_EN.shape) == (E, N)
    # one scale per output channel: that channel's amax / 448
    expect_EN = w_ENK.float().abs().amax(dim=-1) / 448.0
    assert torch.allclose(ws_EN, expect_EN, rtol=1e-6, atol=0)
    back_ENK = R8.dequantize(wq_EKN.transpose(-2, -1), ws_EN)
    assert rel_l2(back_ENK, w_ENK.float()) < 0.03


def test_operands_pass_scaled_grouped_mm_checks():
    """The recipe's operands and scales against _scaled_grouped_mm's shape, dtype and layout
    checks (its meta kernel mirrors the CUDA one's)."""
    M, K, N, E = 64, 32, 48, 3
    aq_MK, as_M = R8.quantize_rows(torch.randn(M, K))
    wq_EKN, ws_EN = R8.quantize_weights(torch.randn(E, N, K))
    offs = torch.tensor([16, 16, 64], dtype=torch.int32)
    meta = [t.to("meta") for t in (aq_MK, as_M, ws_EN, offs)]
    wq_meta = torch.empty_strided(wq_EKN.shape, wq_EKN.stride(), dtype=wq_EKN.dtype, device="meta")
    try:
        y = torch._scaled_grouped_mm(meta[0], wq_meta, meta[1], meta[2], offs=meta[3],
                                     out_dtype=torch.bfloat16, use_fast_accum=True)
    except NotImplementedError as e:
        pytest.skip(f"this torch has no meta kernel for _scaled_grouped_mm: {e}")
    assert tuple(y.shape) == (M, N) and y.dtype == torch.bfloat16


def emulated_mm(a_MK, wq_EKN, ws_EN, offs):
    """CPU twin of torch_recipe_fp8.scaled_grouped_mm: the same quantization, then fp32 matmuls per
    group on the dequantized operands."""
    aq_MK, as_M = R8.quantize_rows(a_MK)
    a_MK = R8.dequantize(aq_MK, as_M)
    w_ENK = R8.dequantize(wq_EKN.transpose(-2, -1), ws_EN)
    y_MN = torch.zeros(a_MK.shape[0], w_ENK.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        y_MN[start:end] = a_MK[start:end] @ w_ENK[e].t()
        start = end
    return y_MN.to(torch.bfloat16)


def plain_mm(a_MK, wq_EKN, ws_EN, offs):
    """No quantization: the bf16 recipe's GEMM, for the exact backward check."""
    del wq_EKN, ws_EN
    return torch._grouped_mm(a_MK, plain_mm.w_ENK.transpose(-2, -1), offs=offs)


def layer(seed, T=32, D=64, F=32, E=4, K=2):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w13_EFD = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).to(torch.bfloat16)
    w2_EDF = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(torch.bfloat16)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids_TK[3, 1] = -1  # an inactive route
    scores_TK = torch.rand(T, K, generator=g)
    grad_y_TD = torch.randn(T, D, generator=g).to(torch.bfloat16)
    return x_TD, ids_TK, scores_TK, w13_EFD, w2_EDF, grad_y_TD


def run(fn, args, grad_y_TD):
    x_TD, ids_TK, scores_TK, w13_EFD, w2_EDF = [a.clone() for a in args]
    for t in (x_TD, scores_TK, w13_EFD, w2_EDF):
        t.requires_grad_(True)
    y_TD = fn(x_TD, ids_TK, scores_TK, w13_EFD, w2_EDF)
    y_TD.backward(grad_y_TD)
    return [y_TD, x_TD.grad, scores_TK.grad, w13_EFD.grad, w2_EDF.grad]


def recipe_fp8(x, ids, scores, w13, w2):
    prepared = (R8.quantize_weights(w13), R8.quantize_weights(w2))
    return R8.moe_forward(x, ids, scores, w13, w2, prepared)


def test_backward_matches_autograd_through_grouped_mm(monkeypatch):
    """With the forward GEMM made the bf16 one, ScaledGroupedMm's gradients equal torch autograd's
    through torch._grouped_mm: the backward GEMMs are the bf16 recipe's."""
    M, K, N, E = 48, 32, 16, 3
    g = torch.Generator().manual_seed(3)
    a_MK = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w_ENK = torch.randn(E, N, K, generator=g).to(torch.bfloat16)
    grad_MN = torch.randn(M, N, generator=g).to(torch.bfloat16)
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)  # expert 1 empty
    a1, w1 = a_MK.clone().requires_grad_(), w_ENK.clone().requires_grad_()
    torch._grouped_mm(a1, w1.transpose(-2, -1), offs=offs).backward(grad_MN)
    plain_mm.w_ENK = w_ENK
    monkeypatch.setattr(R8.ScaledGroupedMm, "mm", staticmethod(plain_mm))
    a2, w2 = a_MK.clone().requires_grad_(), w_ENK.clone().requires_grad_()
    wq, ws = R8.quantize_weights(w_ENK)
    R8.ScaledGroupedMm.apply(a2, w2, wq, ws, offs).backward(grad_MN)
    assert torch.equal(a2.grad, a1.grad)
    assert torch.equal(w2.grad, w1.grad)
    assert a2.grad.dtype == torch.bfloat16 and tuple(w2.grad.shape) == (E, N, K)


def test_recipe_with_emulated_fp8_is_close_to_bf16_recipe(monkeypatch):
    monkeypatch.setattr(R8.ScaledGroupedMm, "mm", staticmethod(emulated_mm))
    *args, grad_y_TD = layer(4)
    ref = run(torch_recipe.moe_forward, args, grad_y_TD)
    got = run(recipe_fp8, args, grad_y_TD)
    names = ["y", "grad_x", "grad_scores", "grad_w13", "grad_w2"]
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = rel_l2(a, b)
        # row-wise e4m3 operands of two chained GEMMs: about 4-7 % here (3 mantissa bits)
        assert 0 < err < 0.12, f"{name}: rel-L2 vs the bf16 recipe {err:.3e}"


def test_unsupported_reason_on_cpu_names_the_op():
    reason = R8.unsupported_reason("cpu")
    assert reason is not None and "_scaled_grouped_mm" in reason


@needs_cuda
def test_scaled_grouped_mm_on_cuda_matches_emulation():
    assert R8.unsupported_reason() is None
    M, K, N, E = 96, 64, 48, 3
    g = torch.Generator().manual_seed(5)
    a_MK = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w_ENK = torch.randn(E, N, K, generator=g).to(torch.bfloat16)
    offs = torch.tensor([32, 32, 96], dtype=torch.int32)
    wq, ws = R8.quantize_weights(w_ENK)
    ref = emulated_mm(a_MK, wq, ws, offs)
    got = R8.scaled_grouped_mm(a_MK.cuda(), wq.cuda(), ws.cuda(), offs.cuda()).cpu()
    assert rel_l2(got, ref) < 1e-2


@needs_cuda
def test_recipe_on_cuda_is_close_to_bf16_recipe():
    *args, grad_y_TD = layer(6)
    args = [a.cuda() for a in args]
    ref = run(torch_recipe.moe_forward, args, grad_y_TD.cuda())
    got = run(recipe_fp8, args, grad_y_TD.cuda())
    for name, a, b in zip(["y", "grad_x", "grad_scores", "grad_w13", "grad_w2"], got, ref):
        err = rel_l2(a, b)
        assert 0 < err < 0.12, f"{name}: rel-L2 vs the bf16 recipe {err:.3e}"
