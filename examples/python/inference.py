"""Inference with an inference context: no activation slots, fixed T with padding rows.

    torchrun --nproc-per-node 2 examples/python/inference.py
    torchrun --nproc-per-node 1 examples/python/inference.py --device cuda

Each call passes T rows (the context's T); rows past the live count carry id -1 and cost nothing,
so ranks with different batch sizes still make the same call.
"""

import torch

import epmoe
from _common import parse, setup, teardown


def main():
    args = parse(__doc__, tokens=(int, 32, "max tokens per rank and call"))
    group, rank, size, device = setup(args.device)
    D, F, K, experts = 128, 64, 2, 4 * size
    T = args.tokens
    config = epmoe.Config(max_num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                          num_experts=experts, inference=True, device_scratch_capacity_factor=2.0)
    print(epmoe.plan_memory(config, size).explain() if rank == 0 else "", end="", flush=True)
    context = epmoe.create_context(group, config, device)
    E = experts // size
    g = torch.Generator().manual_seed(rank)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).bfloat16().to(device)
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).bfloat16().to(device)
    for live in (T, T // 2 + rank, 1):  # decode-like calls with fewer live tokens
        x = torch.zeros(T, D, dtype=torch.bfloat16)
        ids = torch.full((T, K), -1, dtype=torch.int32)
        scores = torch.zeros(T, K)
        x[:live] = torch.randn(live, D, generator=g).bfloat16()
        ids[:live] = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(live)]).int()
        scores[:live] = torch.softmax(torch.randn(live, K, generator=g), -1)
        with torch.inference_mode():
            y = epmoe.routed_experts(x.to(device), ids.to(device), scores.to(device), w13, w2, context)
        assert torch.count_nonzero(y[live:]) == 0 and torch.isfinite(y.float()).all()
        print(f"rank {rank}/{size}: {live} live tokens, |y| = {y.float().norm().item():.4f}", flush=True)
    context.check()
    context.close()
    teardown(group)


if __name__ == "__main__":
    main()
