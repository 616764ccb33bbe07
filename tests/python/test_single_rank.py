"""routed_experts on one CPU rank: numerics against the float64 reference, accepted layouts and
dtypes, padding rows, determinism, and device-side errors that leave the context usable."""

import pytest
import torch

import epmoe
from conftest import D, EXPERTS, F, K, T, tiny_config
from moe_reference import make_problem, reference, rel_l2

TOL = 2e-2  # relative L2 bound of every output against float64 (README: the main job's bound)


def leaf(t):
    return t.clone().requires_grad_()


def test_forward_backward_match_float64_reference(context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=3)
    x, s, w13, w2 = leaf(p.x_RTD[0]), leaf(p.scores_RTK[0]), leaf(p.w13_GFD), leaf(p.w2_GDF)
    y = epmoe.routed_experts(x, p.ids_RTK[0], s, w13, w2, context)
    y.backward(p.grad_y_RTD[0])
    xr, sr, w13r, w2r = (leaf(t.detach().double()) for t in (x, s, w13, w2))
    yr = reference(xr, p.ids_RTK[0], sr, w13r, w2r)
    yr.backward(p.grad_y_RTD[0].double())
    assert y.dtype == torch.bfloat16 and y.shape == (T, D)
    assert rel_l2(y, yr) < TOL
    for got, want, name in ((x.grad, xr.grad, "x"), (s.grad, sr.grad, "scores"),
                            (w13.grad, w13r.grad, "w13"), (w2.grad, w2r.grad, "w2")):
        assert got is not None and rel_l2(got, want) < TOL, name
    assert s.grad.dtype == torch.float32


def test_int64_ids_bf16_scores_and_titan_weight_layout(context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=4)
    y32 = epmoe.routed_experts(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0].bfloat16(), p.w13_GFD,
                               p.w2_GDF, context)
    w13_E2FD = p.w13_GFD.view(EXPERTS, 2, F, D)  # TorchTitan's GroupedLinear layout
    s = leaf(p.scores_RTK[0].bfloat16())
    y64 = epmoe.routed_experts(p.x_RTD[0], p.ids_RTK[0].long(), s, w13_E2FD, p.w2_GDF, context)
    assert torch.equal(y32, y64)
    y64.float().sum().backward()
    assert s.grad.dtype == torch.bfloat16


def test_padding_rows_and_live_count(context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=5)
    live = 7
    n = torch.tensor([live], dtype=torch.int32)
    y = epmoe.routed_experts(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, context,
                             num_tokens=n)
    assert torch.count_nonzero(y[live:]) == 0
    y_short = epmoe.routed_experts(p.x_RTD[0][:live].contiguous(), p.ids_RTK[0][:live].contiguous(),
                                   p.scores_RTK[0][:live].contiguous(), p.w13_GFD, p.w2_GDF, context)
    assert torch.equal(y[:live], y_short)


def test_bitwise_deterministic(context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=6)
    a = epmoe.routed_experts(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, context)
    b = epmoe.routed_experts(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, context)
    assert torch.equal(a, b)


def test_capacity_overflow_is_reported_and_context_stays_usable():
    ctx = epmoe.create_context(None, tiny_config(device_scratch_capacity_factor=0.25), "cpu")
    try:
        p = make_problem(1, T, D, F, K, EXPERTS, seed=7, routing="one-expert")
        bad = torch.zeros(T, K, dtype=torch.int32)  # every route to expert 0: 48 rows > capacity 12
        with pytest.raises(RuntimeError, match=r"\[epmoe:capacity_overflow\]"):
            epmoe.routed_experts(p.x_RTD[0], bad, p.scores_RTK[0], p.w13_GFD, p.w2_GDF, ctx)
        live = torch.tensor([5], dtype=torch.int32)  # 10 routes fit the 12 rows
        y = epmoe.routed_experts(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, ctx,
                                 num_tokens=live)
        want = reference(p.x_RTD[0][:5], p.ids_RTK[0][:5], p.scores_RTK[0][:5], p.w13_GFD, p.w2_GDF)
        assert rel_l2(y[:5], want) < TOL
        ctx.check()  # nothing pending
    finally:
        ctx.close()


def test_inference_context_refuses_autograd_and_runs_without_grad():
    ctx = epmoe.create_context(None, tiny_config(inference=True), "cpu")
    try:
        p = make_problem(1, T, D, F, K, EXPERTS, seed=8)
        with pytest.raises(RuntimeError, match="inference contexts do not support autograd"):
            epmoe.routed_experts(leaf(p.x_RTD[0]), p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, ctx)
        y = epmoe.routed_experts(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, ctx)
        assert rel_l2(y, reference(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF)) < TOL
    finally:
        ctx.close()


def test_several_layers_backward_in_reverse_order():
    ctx = epmoe.create_context(None, tiny_config(max_moe_layers_per_activation_slot=3), "cpu")
    try:
        p = make_problem(1, T, D, F, K, EXPERTS, seed=9)
        x = leaf(p.x_RTD[0])
        h = x
        for _ in range(3):
            h = h + epmoe.routed_experts(h, p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, ctx)
        h.float().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    finally:
        ctx.close()


def test_fp8_block_training_on_cpu_is_close_to_bf16():
    """precision="fp8_block" reaches the C++ FP8 path: different bits from bf16, within the bound
    tests/cpp/tolerances.h sets for FP8 against the bf16 path (rel-L2 <= 0.095 for y and grad_x)."""
    T, D, F, K, E = 16, 128, 64, 2, 4
    torch.manual_seed(5)
    x = torch.randn(T, D).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    s = torch.rand(T, K).softmax(-1)
    w13 = (torch.randn(E, 2 * F, D) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, F) / F ** 0.5).bfloat16()
    gy = torch.randn(T, D).bfloat16()
    out = {}
    for precision in ("bf16", "fp8_block"):
        cfg = epmoe.Config(max_num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                           num_experts=E, precision=precision)
        ctx = epmoe.create_context(None, cfg, "cpu")
        xi = x.clone().requires_grad_(True)
        y = epmoe.routed_experts(xi, ids, s, w13, w2, ctx)
        y.backward(gy)
        out[precision] = (y.detach().float(), xi.grad.float())
        ctx.close()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    for i, name in enumerate(("y", "grad_x")):
        a, b = out["fp8_block"][i], out["bf16"][i]
        assert torch.isfinite(a).all(), name
        assert not torch.equal(a, b), f"{name}: fp8_block gave the bf16 bits"
        assert rel(a, b) <= 0.095, f"{name}: rel-L2 {rel(a, b):.3g} vs the bf16 path"


def test_precision_errors_name_the_field():
    with pytest.raises(ValueError, match="Config.precision"):
        epmoe.Config(max_num_local_input_tokens=8, hidden_dim=64, intermediate_dim=32, top_k=2,
                     num_experts=4, precision="nvfp4")
