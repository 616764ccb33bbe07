"""One forward + backward of one shape at EP = 1, for profilers (ncu, compute-sanitizer):
    python3 bench/one_step.py --shape qwen3-30b-a3b [--routing balanced] [--unfused] [--steps 2]"""
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
    args = ap.parse_args()
    lib = epmoe_ctypes.load(args.lib)
    T = bench_moe.S.SHAPES[args.shape][4]
    layer = bench_moe.Layer(lib, args.shape, args.routing, T, fused=not args.unfused)
    for _ in range(args.steps):
        layer.step()
    layer.ctx.check()
    torch.cuda.synchronize()
    layer.close()


if __name__ == "__main__":
    main()
