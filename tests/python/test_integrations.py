"""The transformers-style strategy and the TorchTitan-style module, ParallelStyle, runtime and
token dispatcher: two CPU processes (gloo) against the unsharded layer in one process."""

import os

import pytest
import torch

from conftest import HERE, has_cuda, requires_cuda, torchrun
from epmoe.integrations import _common, transformers as hf
from moe_reference import rel_l2
from tiny_models import EXPERTS, F, K, R, T, HFSparseMoeBlock, batch, titan_module

TOL = 2e-2
WORKER = os.path.join(HERE, "workers", "integrations_worker.py")


def _launch(out, device="cpu"):
    torchrun(WORKER, "--out", out, "--device", device)
    return lambda name: [torch.load(os.path.join(out, f"{name}_rank{r}.pt")) for r in range(R)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(str(tmp_path_factory.mktemp("integrations")))


def cat(parts, key):
    return torch.cat([p[key] for p in parts])


@pytest.mark.multiprocess
def test_transformers_strategy_matches_unsharded_block(results):
    block = HFSparseMoeBlock(seed=0)  # unsharded, eager experts, all tokens in one process
    x, _, _, gy = batch()
    xr = x.reshape(R * T, -1).clone().requires_grad_()
    y = block(xr)
    y.backward(gy.reshape(R * T, -1))
    got = results("hf")
    assert rel_l2(cat(got, "y"), y) < TOL
    assert rel_l2(cat(got, "grad_x"), xr.grad) < TOL
    assert rel_l2(got[0]["gate_grad"], block.gate.weight.grad) < TOL
    assert rel_l2(cat(got, "w13_grad"), block.experts.gate_up_proj.grad) < TOL
    assert rel_l2(cat(got, "w2_grad"), block.experts.down_proj.grad) < TOL


@pytest.mark.skipif(not (has_cuda() and torch.cuda.device_count() >= 2 and torch.ops.epmoe._has_nccl()),
                    reason="needs 2 GPUs and epmoe built with the NCCL transport")
def test_integrations_on_two_gpus(tmp_path):
    got = _launch(str(tmp_path), "cuda")
    want, _ = _titan_reference(pad_last=3)
    assert rel_l2(cat(got("titan"), "y"), want["y"]) < TOL
    want, _ = _titan_reference()
    assert rel_l2(cat(got("dispatcher"), "y"), want["y"]) < TOL
    block = HFSparseMoeBlock(seed=0)
    x, _, _, _ = batch()
    with torch.no_grad():
        assert rel_l2(cat(got("hf"), "y"), block(x.reshape(R * T, -1))) < TOL


def _titan_reference(pad_last=0):
    m = titan_module(seed=0)
    x, ids, scores, gy = batch()
    ids, scores = ids.clone(), scores.clone()
    if pad_last:
        ids[:, -pad_last:] = -1
    xr = x.reshape(R * T, -1).double().requires_grad_()
    sr = scores.reshape(R * T, K).double().requires_grad_()
    w13 = m.w13.weight.detach().reshape(EXPERTS, 2 * F, -1).double().requires_grad_()
    w2 = m.w2.weight.detach().double().requires_grad_()
    y = _common.eager_experts(xr, ids.reshape(R * T, K), sr, w13, w2)
    y.backward(gy.reshape(R * T, -1).double())
    return dict(y=y, grad_x=xr.grad, grad_scores=sr.grad, w13_grad=w13.grad, w2_grad=w2.grad), ids


@pytest.mark.multiprocess
def test_torchtitan_module_parallel_style_and_runtime(results):
    want, _ = _titan_reference(pad_last=3)
    got = results("titan")
    for key in ("y", "grad_x", "grad_scores", "w2_grad"):
        assert rel_l2(cat(got, key), want[key]) < TOL, key
    w13 = torch.cat([g["w13_grad"].reshape(EXPERTS // R, 2 * F, -1) for g in got])
    assert got[0]["w13_grad"].shape == (EXPERTS // R, 2, F, want["y"].shape[1])  # [E, 2, F, D] kept
    assert rel_l2(w13, want["w13_grad"]) < TOL


@pytest.mark.multiprocess
def test_torchtitan_token_dispatcher(results):
    want, ids = _titan_reference()
    got = results("dispatcher")
    for key in ("y", "grad_x", "grad_scores", "w13_grad", "w2_grad"):
        assert rel_l2(cat(got, key), want[key]) < TOL, key
    flat = ids.reshape(-1)
    for r, g in enumerate(got):
        assert g["counts"].tolist() == [int((flat == r * 2 + e).sum()) for e in range(2)]


def test_auto_rule():
    cpu = torch.device("cpu")
    assert hf.resolve_strategy("auto", ep_size=2, tp_size=2, tokens=64, hidden_dim=32, device=cpu)[0] == "all-reduce"
    big = hf.resolve_strategy("auto", ep_size=2, tp_size=2, tokens=1 << 20, hidden_dim=4096, device=cpu)
    assert big[0] == "epmoe"
    assert hf.resolve_strategy("auto", ep_size=4, tp_size=1, tokens=8, hidden_dim=32, device=cpu)[0] == "epmoe"
    fp32 = hf.resolve_strategy("auto", ep_size=4, tp_size=1, tokens=8, hidden_dim=32, device=cpu, dtype=torch.float32)
    assert fp32[0] == "all-to-all" and "bfloat16" in fp32[1]
    with pytest.raises(ValueError, match="ep strategy: expected one of"):
        hf.resolve_strategy("deepep-v9", ep_size=2, tp_size=1, tokens=8, hidden_dim=32, device=cpu)


def test_importable_without_transformers_and_registration_is_optional():
    registered = hf.register_with_transformers()
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES  # noqa: F401
    except ImportError:  # no transformers (CI), or one without the EP style registry
        assert registered is False
        return
    assert registered
    assert ALL_PARALLEL_STYLES["epmoe_experts"] is hf.PARALLEL_STYLES["epmoe_experts"]
    assert ALL_PARALLEL_STYLES["epmoe_router"] is hf.PARALLEL_STYLES["epmoe_router"]


def test_single_process_strategy_without_group():
    block = HFSparseMoeBlock(seed=0)
    ref = HFSparseMoeBlock(seed=0)
    style = hf.EpmoeExpertsParallel()
    style.install_forward(block.experts)
    x, _, _, _ = batch()
    with torch.no_grad():
        assert rel_l2(block(x[0]), ref(x[0])) < TOL
    style.close(block.experts)


@requires_cuda
def test_torchtitan_module_on_one_gpu():
    m = titan_module(seed=0).cuda()
    runtime = __import__("epmoe.integrations.torchtitan", fromlist=["EpmoeRuntime"]).EpmoeRuntime([m], "cuda", T)
    try:
        want, _ = _titan_reference()
        x, ids, scores, _ = batch()
        xs = x.reshape(R * T, -1)[:T].cuda()
        y = m(xs, scores.reshape(R * T, K)[:T].cuda(), ids.reshape(R * T, K)[:T].cuda())
        assert rel_l2(y.cpu(), want["y"][:T]) < TOL
    finally:
        runtime.close()
