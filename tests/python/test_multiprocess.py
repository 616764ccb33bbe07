"""CPU ranks as processes (torchrun, gloo bootstrap, shared-memory transport): two ranks give the
same results as one unsharded process on the concatenated batch."""

import glob
import os

import pytest
import torch

import epmoe
from conftest import HERE, has_cuda, torchrun
from moe_reference import make_problem, reference, rel_l2

pytestmark = pytest.mark.multiprocess

T, D, F, K, EXPERTS, R = 24, 64, 32, 2, 4, 2
WORKER = os.path.join(HERE, "workers", "ep_worker.py")


def unsharded():
    """One process, one rank, every expert, the R ranks' tokens stacked: the reference layout."""
    p = make_problem(R, T, D, F, K, EXPERTS, seed=31)
    cfg = epmoe.Config(max_num_local_input_tokens=R * T, hidden_dim=D, intermediate_dim=F, top_k=K,
                       num_experts=EXPERTS)
    ctx = epmoe.create_context(None, cfg, "cpu")
    try:
        x = p.x_RTD.reshape(R * T, D).clone().requires_grad_()
        s = p.scores_RTK.reshape(R * T, K).clone().requires_grad_()
        w13, w2 = p.w13_GFD.clone().requires_grad_(), p.w2_GDF.clone().requires_grad_()
        y = epmoe.routed_experts(x, p.ids_RTK.reshape(R * T, K), s, w13, w2, ctx)
        y.backward(p.grad_y_RTD.reshape(R * T, D))
        return p, dict(y=y.detach(), grad_x=x.grad, grad_scores=s.grad, grad_w13=w13.grad, grad_w2=w2.grad)
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ep"))
    torchrun(WORKER, "--scenario", "fused", "--scenario", "layered", "--scenario", "timeout", "--out", out)
    assert not glob.glob("/dev/shm/epmoe-*"), "shared-memory names left behind"
    return out


def _shards(out, name):
    return [torch.load(os.path.join(out, f"{name}_rank{r}.pt")) for r in range(R)]


def test_fused_two_processes_equal_one_unsharded_process(two_ranks):
    _, want = unsharded()
    got = _shards(two_ranks, "fused")
    E = EXPERTS // R
    for key in ("y", "grad_x", "grad_scores"):
        assert torch.equal(torch.cat([g[key] for g in got]), want[key]), key
    for key in ("grad_w13", "grad_w2"):
        assert torch.equal(torch.cat([g[key] for g in got]), want[key]), key
        assert got[0][key].shape[0] == E


def test_layered_two_processes_match_the_float64_reference(two_ranks):
    p, want = unsharded()
    got = _shards(two_ranks, "layered")
    y = torch.cat([g["y"] for g in got])
    assert rel_l2(y, want["y"]) < 1e-2
    x = p.x_RTD.reshape(R * T, D).double().requires_grad_()
    s = p.scores_RTK.reshape(R * T, K).double().requires_grad_()
    w13, w2 = p.w13_GFD.double().requires_grad_(), p.w2_GDF.double().requires_grad_()
    reference(x, p.ids_RTK.reshape(R * T, K), s, w13, w2).backward(p.grad_y_RTD.reshape(R * T, D).double())
    assert rel_l2(torch.cat([g["grad_x"] for g in got]), x.grad) < 2e-2
    assert rel_l2(torch.cat([g["grad_scores"] for g in got]), s.grad) < 2e-2
    assert rel_l2(torch.cat([g["grad_w13"] for g in got]), w13.grad) < 2e-2
    assert rel_l2(torch.cat([g["grad_w2"] for g in got]), w2.grad) < 2e-2
    # tokens per local expert: every active route to an expert of that rank
    ids = p.ids_RTK.reshape(-1)
    for r, g in enumerate(got):
        want_counts = torch.stack([(ids == r * 2 + e).sum() for e in range(2)]).int()
        assert torch.equal(g["tokens_per_expert"], want_counts)


def test_barrier_timeout_names_the_missing_rank(two_ranks):
    message = open(os.path.join(two_ranks, "timeout_rank0.txt")).read()
    assert "[epmoe:timeout]" in message, message
    assert "no arrival from rank(s) 1" in message, message
    assert "300 ms" in message, message


@pytest.mark.skipif(not (has_cuda() and torch.cuda.device_count() >= 2 and torch.ops.epmoe._has_nccl()),
                    reason="needs 2 GPUs and epmoe built with the NCCL transport")
def test_two_gpus_fused_and_layered(tmp_path):
    torchrun(WORKER, "--device", "cuda", "--scenario", "fused", "--scenario", "layered", "--out", str(tmp_path))
    p, want = unsharded()
    fused = _shards(str(tmp_path), "fused")
    for key in ("y", "grad_x", "grad_scores", "grad_w13", "grad_w2"):
        assert rel_l2(torch.cat([g[key] for g in fused]), want[key]) < 2e-2, key
    layered = _shards(str(tmp_path), "layered")
    assert rel_l2(torch.cat([g["y"] for g in layered]), want["y"]) < 2e-2
