"""Memory planning: what a context allocates per rank, before any device or process group exists.

    python examples/python/memory_plan.py --shape deepseek-v3 --ep-size 8
    torchrun --nproc-per-node 2 examples/python/memory_plan.py      # rank 0 prints

plan_memory is pure: it needs no GPU and no communication.
"""

import argparse
import os

import epmoe

SHAPES = {  # D, F, global experts, K, T (training, per rank)
    "ci-tiny": (128, 96, 8, 2, 64),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 8192),
    "deepseek-v3": (7168, 2048, 256, 8, 4096),
    "gpt-oss-120b": (2880, 2880, 128, 4, 8192),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--ep-size", type=int, default=int(os.environ.get("WORLD_SIZE", 8)))
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    ap.add_argument("--layers-in-flight", type=int, default=1)
    args = ap.parse_args()
    if int(os.environ.get("RANK", 0)) != 0:
        return
    D, F, E, K, T = SHAPES[args.shape]
    config = epmoe.Config(max_num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                          num_experts=E, device_scratch_capacity_factor=args.capacity_factor,
                          max_moe_layers_per_activation_slot=args.layers_in_flight)
    plan = epmoe.plan_memory(config, args.ep_size)
    print(plan.explain())
    print(f"{args.shape} at EP={args.ep_size}: {plan.total_bytes / 2**30:.3f} GiB per rank, "
          f"{plan.recv_capacity_rows} receive rows")
    inference = epmoe.plan_memory(epmoe.Config(**{**config.__dict__, "inference": True}), args.ep_size)
    print(f"inference context: {inference.total_bytes / 2**30:.3f} GiB per rank")


if __name__ == "__main__":
    main()
