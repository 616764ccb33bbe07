"""Layered ops on one CPU rank: dispatch -> grouped_gemm -> SwiGLU -> grouped_gemm -> combine
matches the fused op; the layout's expert offsets group the received rows by expert."""

import torch

import epmoe
from conftest import D, EXPERTS, F, K, T
from moe_reference import make_problem, reference, rel_l2


def swiglu(h13):
    return (torch.nn.functional.silu(h13[:, :F].float()) * h13[:, F:].float()).bfloat16()


def test_layered_matches_fused_and_reference(context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=51)
    args = (p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0])
    fused = epmoe.routed_experts(*args, p.w13_GFD, p.w2_GDF, context)
    recv, handle = epmoe.dispatch(*args, context)
    assert recv.shape == (context.capacity_rows, D)
    off = handle.expert_offsets.tolist()
    ids = p.ids_RTK[0]
    assert off[0] == 0 and [off[e + 1] - off[e] for e in range(EXPERTS)] == [int((ids == e).sum()) for e in range(EXPERTS)]
    for e in range(EXPERTS):  # every row of expert e is a token that chose e
        tok = (ids == e).any(dim=1).nonzero().flatten()
        assert torch.equal(recv[off[e]:off[e + 1]], p.x_RTD[0][tok])
    assert torch.count_nonzero(recv[off[-1]:]) == 0
    y = epmoe.combine(epmoe.grouped_gemm(swiglu(epmoe.grouped_gemm(recv, p.w13_GFD, handle)), p.w2_GDF, handle), handle)
    assert rel_l2(y, fused) < 1e-2
    assert rel_l2(y, reference(*args, p.w13_GFD, p.w2_GDF)) < 2e-2


def test_layered_gradients_match_reference(context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=52)
    x, s = p.x_RTD[0].clone().requires_grad_(), p.scores_RTK[0].clone().requires_grad_()
    w13, w2 = p.w13_GFD.clone().requires_grad_(), p.w2_GDF.clone().requires_grad_()
    recv, handle = epmoe.dispatch(x, p.ids_RTK[0], s, context)
    y = epmoe.combine(epmoe.grouped_gemm(swiglu(epmoe.grouped_gemm(recv, w13, handle)), w2, handle), handle)
    y.backward(p.grad_y_RTD[0])
    xr, sr, w13r, w2r = (t.detach().double().requires_grad_() for t in (x, s, w13, w2))
    reference(xr, p.ids_RTK[0], sr, w13r, w2r).backward(p.grad_y_RTD[0].double())
    for got, want in ((x.grad, xr.grad), (s.grad, sr.grad), (w13.grad, w13r.grad), (w2.grad, w2r.grad)):
        assert rel_l2(got, want) < 2e-2


def test_layered_and_fused_calls_interleave(context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=53)
    args = (p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0])
    recv, handle = epmoe.dispatch(*args, context)
    fused = epmoe.routed_experts(*args, p.w13_GFD, p.w2_GDF, context)  # between dispatch and combine
    y = epmoe.combine(epmoe.grouped_gemm(swiglu(epmoe.grouped_gemm(recv, p.w13_GFD, handle)), p.w2_GDF, handle), handle)
    assert rel_l2(y, fused) < 1e-2
