"""One CPU rank of the integration tests (torchrun, gloo): the transformers-style strategy, the
TorchTitan-style module + ParallelStyle + runtime, and the TorchTitan-style token dispatcher, each
on this rank's batch; results saved for the parent test to compare with one unsharded process."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from epmoe.integrations import _common, transformers as hf, torchtitan as tt
from tiny_models import EXPERTS, F, K, T, HFSparseMoeBlock, batch, titan_module

DEVICE = torch.device("cpu")


def host(d):
    return {k: _common.local(v).cpu() for k, v in d.items()}  # DTensor grads: this rank's shard


def run_hf(rank, mesh, out):
    block = HFSparseMoeBlock(seed=0).to(DEVICE)
    name, why = hf.resolve_strategy("auto", ep_size=2, tp_size=1, tokens=T, hidden_dim=block.gate.in_features,
                                    device=DEVICE)
    assert name == "epmoe", (name, why)
    router_style, experts_style = (hf.PARALLEL_STYLES[s] for s in hf.STRATEGIES[name])
    router_style.install_forward(block.gate, mesh)
    experts_style = hf.EpmoeExpertsParallel(max_tokens=T + 4)  # padded rows exercise id -1
    experts_style.install_forward(block.experts, mesh)  # transformers' call: (module, mesh)
    w13 = block.experts.gate_up_proj
    assert type(w13).__name__ == "DTensor" and _common.local(w13).shape[0] == EXPERTS // 2
    x, _, _, gy = batch()
    xr = x[rank].to(DEVICE).requires_grad_()
    y = block(xr)
    y.backward(gy[rank].to(DEVICE))
    gate_grad = block.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)  # the router is replicated: its gradient sums over the ranks' batches
    torch.save(host(dict(y=y.detach(), grad_x=xr.grad, gate_grad=gate_grad, w13_grad=block.experts.gate_up_proj.grad,
                         w2_grad=block.experts.down_proj.grad)), os.path.join(out, f"hf_rank{rank}.pt"))
    experts_style.close(block.experts)


def run_titan(rank, mesh, out):
    m = parallelize_module(titan_module(seed=0).to(DEVICE), mesh, tt.EpmoeExpertParallel())
    assert m.w13.weight.shape[0] == EXPERTS // 2
    runtime = tt.EpmoeRuntime([m], DEVICE, tokens_per_microbatch=T)
    x, ids, scores, gy = batch()
    xr, sr = x[rank].to(DEVICE).requires_grad_(), scores[rank].to(DEVICE).requires_grad_()
    pad = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    pad[-3:] = True
    y = m(xr, sr, ids[rank].to(DEVICE), padding_mask_T=pad)
    assert torch.count_nonzero(y[-3:]) == 0
    y.backward(gy[rank].to(DEVICE))
    torch.save(host(dict(y=y.detach(), grad_x=xr.grad, grad_scores=sr.grad, w13_grad=m.w13.weight.grad,
                         w2_grad=m.w2.weight.grad)), os.path.join(out, f"titan_rank{rank}.pt"))
    runtime.close()


def run_dispatcher(rank, mesh, out):
    d = tt.EpmoeTokenDispatcher(tt.EpmoeTokenDispatcher.Config(num_experts=EXPERTS, top_k=K, hidden_dim=32,
                                                               num_max_tokens_per_rank=T), device=DEVICE)
    d.wire_meshes(mesh)
    d.init_buffer()
    full = titan_module(seed=0)
    E = EXPERTS // 2
    w13 = full.w13.weight.detach()[rank * E:(rank + 1) * E].reshape(E, 2 * F, -1).to(DEVICE).requires_grad_()
    w2 = full.w2.weight.detach()[rank * E:(rank + 1) * E].to(DEVICE).requires_grad_()
    x, ids, scores, gy = batch()
    xr, sr = x[rank].to(DEVICE).requires_grad_(), scores[rank].to(DEVICE).requires_grad_()
    routed, counts, meta = d.dispatch(xr, sr, ids[rank].to(DEVICE))
    # The framework's own expert compute on the expert-grouped rows.
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    outs = [routed.new_zeros(routed.shape)]
    for e in range(E):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            h13 = routed[a:b].float() @ w13[e].float().t()
            h = torch.nn.functional.silu(h13[:, :F]) * h13[:, F:]
            rows = torch.zeros_like(routed, dtype=torch.float32)
            rows[a:b] = h @ w2[e].float().t()
            outs.append(rows.bfloat16())
    y = d.combine(sum(outs), meta, xr)
    y.backward(gy[rank].to(DEVICE))
    torch.save(host(dict(y=y.detach(), grad_x=xr.grad, grad_scores=sr.grad, w13_grad=w13.grad, w2_grad=w2.grad,
                         counts=counts.clone())), os.path.join(out, f"dispatcher_rank{rank}.pt"))
    d.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args()
    global DEVICE
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    mesh = init_device_mesh(a.device, (dist.get_world_size(),), mesh_dim_names=("ep",))
    rank = dist.get_rank()
    for fn in (run_hf, run_titan, run_dispatcher):
        fn(rank, mesh, a.out)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
