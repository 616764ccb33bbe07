"""One forward + backward of one shape at EP = 1, for profilers (ncu, compute-sanitizer):
    python3 bench/one_step.py --shape qwen3-30b-a3b [--routing balanced] [--unfused] [--steps 2]
        [--precision bf16|fp8-train] [--profile]
--profile: the torch profiler (CUPTI) over the last step; prints each kernel's summed device time,
the per-kernel view Nsight Systems would give (nsys does not run on the GPU machine)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402
import epmoe_ctypes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--unfused", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lib", default=None)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8-train"))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    lib = epmoe_ctypes.load(args.lib)
    T = bench_moe.S.SHAPES[args.shape][4]
    layer = bench_moe.Layer(lib, args.shape, args.routing, T, fused=not args.unfused,
                            precision=args.precision)
    for _ in range(args.steps - 1 if args.profile else args.steps):
        layer.step()
    layer.ctx.check()
    torch.cuda.synchronize()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer.step()
            torch.cuda.synchronize()
        layer.ctx.check()
        print(f"{args.shape} {args.routing} {args.precision}: one fwd+bwd step, kernels by device time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=200))
    layer.close()


if __name__ == "__main__":
    main()
