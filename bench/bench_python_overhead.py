"""Host overhead of the Python call over the C++ entry point (bound: < 10 us per call on the GPU).

    python bench/bench_python_overhead.py                 # cuda when present, else cpu
    python bench/bench_python_overhead.py --device cpu --tokens 1

Times, per call, N forward calls (no grad: the inference path; and with grad: the training
forward through the registered autograd) of one tiny layer, so that device time is small and host
time shows:
  cpp        Context::forward in a C++ loop (torch.ops.epmoe._bench_forward), with the same output
             allocation and tensor views as the op
  raw_op     torch.ops.epmoe.routed_experts_fwd (dispatcher + autograd kernel, no Python checks)
  api        epmoe.routed_experts (argument checks + op)
  api_grad   epmoe.routed_experts with inputs that require grad (saves for backward; each call's
             backward runs untimed to free the slot)
'enqueue' is the host time until the last call returns; 'total' waits for the device too. The
overhead is api - cpp on enqueue time (medians over --repeats timings of --iters calls). Prints a table and a JSON line; exits 1 when the no-grad
overhead exceeds --bound-us.
"""

import argparse
import json
import statistics
import time

import torch

import epmoe


def timed(fn, iters, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    enq = fn(iters)
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (enq if enq is not None else t1 - t0) / iters * 1e6, (t2 - t0) / iters * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    # On CUDA few enough calls per timing that their launches fit the launch queue (~1024): a full
    # queue would make the host wait for the device and hide the host overhead being measured.
    ap.add_argument("--iters", type=int, default=None, help="calls per timing (default: 50 on cuda, 200 on cpu)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--bound-us", type=float, default=10.0)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.iters is None:
        args.iters = 50 if device.type == "cuda" else 200
    T, D, F, K, E = args.tokens, args.hidden, args.inter, 2, args.experts
    cfg = epmoe.Config(max_num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K, num_experts=E,
                       max_moe_layers_per_activation_slot=1)
    ctx = epmoe.create_context(None, cfg, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g).bfloat16().to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int().to(device)
    s = torch.rand(T, K, generator=g).to(device)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.05).bfloat16().to(device)
    w2 = (torch.randn(E, D, F, generator=g) * 0.05).bfloat16().to(device)
    opts = epmoe.ExecutionOptions(validate_values=False)  # host value checks would sync on CUDA
    op = torch.ops.epmoe.routed_experts_fwd.default

    def cpp(n):
        return torch.ops.epmoe._bench_forward(x, ids, s, w13, w2, ctx.id, n)[0]

    def raw(n):
        with torch.no_grad():
            for _ in range(n):
                op(x, ids, s, w13, w2, None, ctx.id, False, 0)

    def api(n):
        with torch.no_grad():
            for _ in range(n):
                epmoe.routed_experts(x, ids, s, w13, w2, ctx, options=opts)

    xg = x.clone().requires_grad_()
    gy = torch.ones_like(x)
    grad_time = [0.0]

    def api_grad(n):
        total = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            y = epmoe.routed_experts(xg, ids, s, w13, w2, ctx, options=opts)
            total += time.perf_counter() - t0
            y.backward(gy)  # untimed: frees the activation slot
        grad_time[0] = total
        return total

    results = {}
    for name, fn in (("cpp", cpp), ("raw_op", raw), ("api", api), ("api_grad", api_grad)):
        fn(10)  # warm-up
        runs = [timed(fn, args.iters, device) for _ in range(args.repeats)]
        results[name] = dict(enqueue_us=statistics.median(r[0] for r in runs),
                             total_us=statistics.median(r[1] for r in runs))
    ctx.check()
    ctx.close()
    base = results["cpp"]["enqueue_us"]
    print(f"device {device}, T={T} D={D} F={F} K={K} E={E}, {args.iters} calls x {args.repeats} repeats (median)")
    print(f"{'path':10s} {'enqueue us/call':>16s} {'total us/call':>14s} {'over cpp':>9s}")
    for name, r in results.items():
        print(f"{name:10s} {r['enqueue_us']:16.2f} {r['total_us']:14.2f} {r['enqueue_us'] - base:9.2f}")
    overhead = results["api"]["enqueue_us"] - base
    summary = dict(device=str(device), overhead_us=overhead, bound_us=args.bound_us, results=results)
    print(json.dumps(summary))
    if overhead > args.bound_us:
        print(f"FAIL: the Python call adds {overhead:.2f} us over the C++ entry point (bound {args.bound_us} us)")
        raise SystemExit(1)
    print(f"ok: the Python call adds {overhead:.2f} us over the C++ entry point (bound {args.bound_us} us)")


if __name__ == "__main__":
    main()
