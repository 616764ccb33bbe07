"""One forward + backward of one shape at EP = 1, for profilers (ncu, compute-sanitizer):
    python3 bench/one_step.py --shape qwen3-30b-a3b [--routing balanced] [--unfused] [--steps 2]
        [--precision bf16|fp8-train|fp8|nvfp4|mxfp8] [--decode] [--profile]
The inference precisions (fp8, nvfp4, mxfp8: weights prepared once) run the forward only; --decode
takes the shape's decode T (MEASURE.md, T = 128) instead of its training T.
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
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8-train", "fp8", "nvfp4", "mxfp8"))
    ap.add_argument("--decode", action="store_true", help="the shape's decode T")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    lib = epmoe_ctypes.load(args.lib)
    T = bench_moe.S.SHAPES[args.shape][5 if args.decode else 4]
    layer = bench_moe.Layer(lib, args.shape, args.routing, T, fused=not args.unfused,
                            precision=args.precision)
    run = (lambda: layer.forward(False)) if layer.inference else layer.step
    what = "one forward" if layer.inference else "one fwd+bwd step"
    for _ in range(args.steps - 1 if args.profile else args.steps):
        run()
    layer.ctx.check()
    torch.cuda.synchronize()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        layer.ctx.check()
        print(f"{args.shape} {args.routing} {args.precision} T {T}: {what}, kernels by device time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=200))
    layer.close()


if __name__ == "__main__":
    main()
