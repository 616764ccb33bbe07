"""One GPU (EP = 1): numerics against the CPU reference backend, CUDA-graph capture through
torch.cuda.graph, torch.compile, errors reported by the device status word. Skipped without a GPU."""

import pytest
import torch

import epmoe
from conftest import D, EXPERTS, F, K, T, requires_cuda, tiny_config
from moe_reference import make_problem, reference, rel_l2

pytestmark = requires_cuda
TOL = 2e-2


@pytest.fixture
def gpu_context():
    ctx = epmoe.create_context(None, tiny_config(max_moe_layers_per_activation_slot=2), "cuda")
    yield ctx
    ctx.close()


def cuda_args(p, grad=False):
    x, s = p.x_RTD[0].cuda(), p.scores_RTK[0].cuda()
    w13, w2 = p.w13_GFD.cuda(), p.w2_GDF.cuda()
    if grad:
        x, s, w13, w2 = (t.requires_grad_() for t in (x, s, w13, w2))
    return x, p.ids_RTK[0].cuda(), s, w13, w2


def test_forward_backward_match_cpu_backend_and_float64(gpu_context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=41)
    x, ids, s, w13, w2 = cuda_args(p, grad=True)
    y = epmoe.routed_experts(x, ids, s, w13, w2, gpu_context)
    y.backward(p.grad_y_RTD[0].cuda())
    gpu_context.check()
    cpu = epmoe.create_context(None, tiny_config(), "cpu")
    try:
        xc, sc, w13c, w2c = (t.detach().cpu().requires_grad_() for t in (x, s, w13, w2))
        yc = epmoe.routed_experts(xc, p.ids_RTK[0], sc, w13c, w2c, cpu)
        yc.backward(p.grad_y_RTD[0])
    finally:
        cpu.close()
    assert rel_l2(y.cpu(), yc) < TOL
    assert rel_l2(y.cpu(), reference(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF)) < TOL
    for got, want in ((x.grad, xc.grad), (s.grad, sc.grad), (w13.grad, w13c.grad), (w2.grad, w2c.grad)):
        assert rel_l2(got.cpu(), want) < TOL


def test_cuda_graph_capture_equals_eager(gpu_context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=42)
    x, ids, s, w13, w2 = cuda_args(p)
    with torch.no_grad():
        eager = epmoe.routed_experts(x, ids, s, w13, w2, gpu_context)  # warm-up outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = epmoe.routed_experts(x, ids, s, w13, w2, gpu_context)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, eager)
        q = make_problem(1, T, D, F, K, EXPERTS, seed=43)  # new values into the captured inputs
        x.copy_(q.x_RTD[0].cuda())
        ids.copy_(q.ids_RTK[0].cuda())
        s.copy_(q.scores_RTK[0].cuda())
        graph.replay()
        want = epmoe.routed_experts(x, ids, s, w13, w2, gpu_context)
        torch.cuda.synchronize()
        assert torch.equal(static_y, want)
    gpu_context.check()


def test_cuda_graph_capture_of_forward_and_backward(gpu_context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=44)
    x, ids, s, w13, w2 = cuda_args(p, grad=True)
    gy = p.grad_y_RTD[0].cuda()

    def step():
        y = epmoe.routed_experts(x, ids, s, w13, w2, gpu_context)
        return (y,) + torch.autograd.grad(y, (x, s, w13, w2), gy)

    # Detached: a live autograd graph would keep the leaves' gradient accumulators, made on the
    # default stream, into the capture (torch then makes the legacy stream wait on the capture).
    eager = tuple(t.detach() for t in step())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, eager):
        assert torch.equal(a, b)


def test_compile_fullgraph_on_gpu(gpu_context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=45)
    args = cuda_args(p)

    def f(x, ids, s, w13, w2):
        return x + epmoe.routed_experts(x, ids, s, w13, w2, gpu_context)

    with torch.no_grad():
        assert torch.equal(torch.compile(f, fullgraph=True)(*args), f(*args))


def test_device_status_reports_bad_ids_and_context_survives(gpu_context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=46)
    x, ids, s, w13, w2 = cuda_args(p)
    bad = ids.clone()
    bad[1, 0] = EXPERTS + 3
    with torch.no_grad():
        epmoe.routed_experts(x, bad, s, w13, w2, gpu_context)  # no host read of ids on CUDA
        with pytest.raises(RuntimeError, match=r"\[epmoe:invalid_routing\]"):
            gpu_context.check()
        y = epmoe.routed_experts(x, ids, s, w13, w2, gpu_context)
    gpu_context.check()
    assert rel_l2(y.cpu(), reference(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF)) < TOL


def test_host_tensor_into_gpu_context_is_rejected(gpu_context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=47)
    x, ids, s, w13, w2 = cuda_args(p)
    with pytest.raises(ValueError, match="x_TD: expected device cuda:0, got cpu"):
        epmoe.routed_experts(x.cpu(), ids, s, w13, w2, gpu_context)


def test_layered_on_gpu_matches_fused(gpu_context):
    p = make_problem(1, T, D, F, K, EXPERTS, seed=48)
    x, ids, s, w13, w2 = cuda_args(p)
    with torch.no_grad():
        fused = epmoe.routed_experts(x, ids, s, w13, w2, gpu_context)
        recv, handle = epmoe.dispatch(x, ids, s, gpu_context)
        h13 = epmoe.grouped_gemm(recv, w13, handle)
        h = (torch.nn.functional.silu(h13[:, :F].float()) * h13[:, F:].float()).bfloat16()
        y = epmoe.combine(epmoe.grouped_gemm(h, w2, handle), handle)
    gpu_context.check()
    assert rel_l2(y, fused) < 1e-2


def test_transformers_strategy_on_one_gpu():
    from epmoe.integrations import transformers as hf
    from tiny_models import HFSparseMoeBlock, batch

    block, ref = HFSparseMoeBlock(seed=0).cuda(), HFSparseMoeBlock(seed=0).cuda()
    style = hf.EpmoeExpertsParallel()
    style.install_forward(block.experts)
    x = batch()[0][0].cuda()
    with torch.no_grad():
        assert rel_l2(block(x), ref(x)) < TOL
    style.close(block.experts)
