"""Activation-slot benchmark (docs/memory.md "Benchmark"): a stack of 4 MoE layers, forward 0..3
then backward 3..0 (x_{l+1} = y_l), at EP = 1 on one GPU, epmoe with one slot of 4 layers at the
slot budgets {default (maximum useful), full save (factor 1), half (0.5), minimum (0)} against the
torch-native recipe (bench/torch_recipe.py) with autograd's default saving, on the same inputs.

Peak memory of a step = torch.cuda.max_memory_allocated during the step above the allocation
just before its forward (weights, inputs and the weight-gradient buffers are allocated up front:
baseline for both) + the device memory the epmoe context holds for its lifetime (arena, symmetric
buffers, status word, peer tables, planner state). The recipe accumulates its weight gradients
into the same preallocated buffers; autograd first computes each weight gradient into a
temporary, so its figure is also given less one w13-gradient temporary (an activation-only
lower bound, the figure the target is judged on). Step time: CUDA events around the whole step,
median after warmup. Numerics: every budget's y, grad_x, grad_scores and weight gradients are
compared bitwise (torch.equal) with the full-save budget's.

    python3 bench/bench_slots.py --out bench_slots.json [--shapes qwen3-30b-a3b,deepseek-v3]
    python3 bench/bench_slots.py --cpu --out slots_cpu.json     CPU backend smoke check (ci-tiny)
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import epmoe_ctypes  # noqa: E402
import shapes as S  # noqa: E402
import torch_recipe  # noqa: E402

LAYERS = 4
# (name, Config.slots.slot_capacity_factor; None: unset, the maximum useful slot). Full save runs
# first: the others are compared bitwise with its outputs.
BUDGETS = (("full save", 1.0), ("default", None), ("half", 0.5), ("minimum", 0.0))
ROUTING = "balanced"
# Targets of the benchmark (issue 6).
MIN_PEAK_RATIO, MIN_TIME_RATIO, FULL_SAVE_TIME_RATIO = 0.40, 1.25, 1.02


class Stack:
    """LAYERS layers at one shape: each its own routing (balanced; scores calibrated) and, when
    `shared` is False, its own weights and weight-gradient buffers; shared: one set for all layers
    (gradients accumulate over the layers, as for a parameter used LAYERS times)."""

    def __init__(self, shape, T, device, shared, seed=0):
        D, F, E, K, _, _ = S.SHAPES[shape]
        self.shape, self.T, self.D, self.F, self.E, self.K = shape, T, D, F, E, K
        self.device, self.shared = device, shared
        g = torch.Generator(device=device).manual_seed(seed)
        sets = 1 if shared else LAYERS

        def weight(*size, fan_in):
            return torch.randn(*size, device=device, dtype=torch.bfloat16, generator=g).mul_(fan_in ** -0.5)

        self.w13 = [weight(E, 2 * F, D, fan_in=D) for _ in range(sets)]
        self.w2 = [weight(E, D, F, fan_in=F) for _ in range(sets)]
        self.grad_w13 = [torch.zeros_like(w) for w in self.w13]
        self.grad_w2 = [torch.zeros_like(w) for w in self.w2]
        routes = [S.route(ROUTING, T, E, K, generator=g, device=device) for _ in range(LAYERS)]
        self.ids = [r[0] for r in routes]
        self.scores = [r[1] for r in routes]
        self.x = torch.randn(T, D, device=device, dtype=torch.bfloat16, generator=g)
        self.grad_y = torch.randn(T, D, device=device, dtype=torch.bfloat16, generator=g)
        self.routes = sum(S.useful_routes(i) for i in self.ids)
        self.calibrate_scores()
        # Recipe leaves, one per layer: the weights' storage, .grad the same gradient buffers, into
        # which autograd adds each layer's gradient as soon as it is computed. (One leaf used by
        # every layer would instead have autograd sum the layers' gradients in a buffer of its own
        # until the last of them arrives.)
        self.w13_leaf, self.w2_leaf = [], []
        for l in range(LAYERS):
            w13, w2, grad_w13, grad_w2 = self.weights(l)
            self.w13_leaf.append(w13.detach().requires_grad_())
            self.w2_leaf.append(w2.detach().requires_grad_())
            self.w13_leaf[-1].grad, self.w2_leaf[-1].grad = grad_w13, grad_w2

    def calibrate_scores(self):
        """Scales each layer's scores so that its y has an RMS near 1: y is linear in the scores,
        and a stack without norms or residuals otherwise shrinks towards zeros or grows past
        bf16's range within four layers (MEASURE.md: random inputs, never zeros)."""
        with torch.no_grad():
            x = self.x
            for l in range(LAYERS):
                w13, w2, _, _ = self.weights(l)
                y = torch_recipe.moe_forward(x, self.ids[l], self.scores[l], w13, w2).float()
                rms = float(y.pow(2).mean().sqrt())
                if rms > 0:
                    self.scores[l].mul_(1.0 / rms)
                    y.mul_(1.0 / rms)
                x = y.to(torch.bfloat16)

    def weights(self, layer):
        i = 0 if self.shared else layer
        return self.w13[i], self.w2[i], self.grad_w13[i], self.grad_w2[i]

    def zero_grads(self):
        for g in self.grad_w13 + self.grad_w2:
            g.zero_()


def config(lib, st, factor):
    c = lib.epmoe_config_default(st.T, st.D, st.F, st.K, st.E)
    c.num_slots, c.layers_per_slot = 1, LAYERS
    c.slot_capacity_factor = -1.0 if factor is None else factor
    return c


def epmoe_step(ctx, st, keep=None):
    """Forward 0..LAYERS-1, backward LAYERS-1..0. Returns what the caller of a real step would
    hold after it (last y, grad_x of layer 0, every layer's grad_scores) and the saved handles.
    keep (dict of lists): every layer's y and grad_x too (numerics)."""
    saved, x = [], st.x
    for l in range(LAYERS):
        w13, w2, _, _ = st.weights(l)
        y = torch.empty_like(st.x)
        saved.append(ctx.forward(x, st.ids[l], st.scores[l], w13, w2, y))
        if keep is not None:
            keep["y"].append(y)
        x = y  # the previous layer's y is freed here: epmoe saved what its backward needs
    grad_y, grad_scores = st.grad_y, []
    for l in reversed(range(LAYERS)):
        w13, w2, grad_w13, grad_w2 = st.weights(l)
        grad_x = torch.empty_like(st.x)
        gs = torch.empty(st.T, st.K, device=st.device, dtype=torch.float32)
        ctx.backward(saved[l], grad_y, st.ids[l], st.scores[l], w13, w2, grad_x, gs, grad_w13, grad_w2,
                     accumulate=st.shared and l < LAYERS - 1)
        grad_scores.insert(0, gs)
        if keep is not None:
            keep["grad_x"].insert(0, grad_x)
        grad_y = grad_x
    return (x, grad_y, grad_scores), saved


def recipe_step(st, marks=None):
    """The same stack through the torch-native recipe, autograd saving by default; weight
    gradients accumulate into the stack's buffers (zeroed by the caller). marks (dict): the
    allocation at the end of the forward."""
    x0 = st.x.detach().requires_grad_()
    scores = [s.detach().requires_grad_() for s in st.scores]
    x = x0
    for l in range(LAYERS):
        x = torch_recipe.moe_forward(x, st.ids[l], scores[l], st.w13_leaf[l], st.w2_leaf[l])
    if marks is not None and st.device == "cuda":
        marks["forward_end"] = torch.cuda.memory_allocated()
    x.backward(st.grad_y)
    return x.detach(), x0.grad, [s.grad for s in scores]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def step_times(fn, device, iters, warmup, before=None):
    """Milliseconds of each of iters steps after warmup ones: CUDA events around each step on the
    GPU, the host clock on the CPU; before() runs ahead of each step, untimed."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), min(times), max(times)


def step_peak(fn, device):
    """Bytes allocated by torch during fn() at its peak, above the allocation before it (None on
    the CPU, where torch keeps no such count)."""
    if device != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def bitwise_equal(ref_host, t, chunk=1 << 28):
    """torch.equal of a host copy and a tensor, in chunks (weight gradients of deepseek-v3 are
    15 GB)."""
    if ref_host.shape != t.shape or ref_host.dtype != t.dtype:
        return False
    a, b = ref_host.reshape(-1), t.reshape(-1)
    return all(torch.equal(a[i:i + chunk].to(b.device), b[i:i + chunk])
               for i in range(0, a.numel(), chunk))


def outputs_of(st, keep, grad_scores):
    """Every output of a kept step, by name: y and grad_x of each layer, grad_scores, weight grads."""
    out = {}
    for l in range(LAYERS):
        out[f"y{l}"], out[f"grad_x{l}"], out[f"grad_scores{l}"] = keep["y"][l], keep["grad_x"][l], grad_scores[l]
    for i in range(len(st.w13)):
        out[f"grad_w13_{i}"], out[f"grad_w2_{i}"] = st.grad_w13[i], st.grad_w2[i]
    return out


def rel_l2(a, b):
    a, b = a.detach().float().reshape(-1), b.detach().float().reshape(-1)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def plan_fits(lib, shape, T, shared, free_bytes):
    """Rough device bytes of one shape's run: weights and their gradients, the largest epmoe
    context, and the recipe's saved state (x rows and their fp32 combine copy, h13, SwiGLU, h per
    layer), one step's transients and one w13-gradient temporary."""
    D, F, E, K, _, _ = S.SHAPES[shape]
    sets = 1 if shared else LAYERS
    weights = 2 * sets * 3 * E * F * D * 2
    c = lib.epmoe_config_default(T, D, F, K, E)
    c.layers_per_slot = LAYERS
    context = epmoe_ctypes.plan_slots(lib, c)["device_total_bytes"]
    N = T * K + 16 * E
    recipe = LAYERS * N * (2 * D + 4 * D + 2 * 2 * F + 2 * F + 2 * F) + 3 * N * D * 4 + 2 * E * 2 * F * D
    need = weights + max(context, recipe)
    return need <= 0.85 * free_bytes, need


def choose_sizes(lib, shape, device, force_shared=False):
    """(T, shared) for a shape: bench_moe's per-rank tokens and one weight set per layer where they
    fit next to the rest, else one shared weight set, else fewer tokens (each printed)."""
    T = S.SHAPES[shape][4]
    if device != "cuda":
        return T, force_shared
    free = torch.cuda.mem_get_info()[0]
    for shared in ((True,) if force_shared else (False, True)):
        fits, need = plan_fits(lib, shape, T, shared, free)
        if fits:
            if shared and not force_shared:
                print(f"{shape}: {LAYERS} weight sets and their gradients do not fit in "
                      f"{free / 2**30:.0f} GiB next to the rest; the {LAYERS} layers share one "
                      f"weight set (each its own routing and inputs; gradients accumulate)", flush=True)
            return T, shared
    while T > 256:
        T //= 2
        fits, need = plan_fits(lib, shape, T, True, free)
        if fits:
            print(f"{shape}: T = {S.SHAPES[shape][4]} does not fit in {free / 2**30:.0f} GiB with "
                  f"the recipe; T = {T} (estimated {need / 2**30:.0f} GiB)", flush=True)
            return T, True
    print(f"{shape}: does not fit in {free / 2**30:.0f} GiB even at T = {T}; trying anyway", flush=True)
    return T, True


def bench_shape(lib, shape, device, iters, warmup, rows, targets, force_shared=False):
    T, shared = choose_sizes(lib, shape, device, force_shared)
    st = Stack(shape, T, device, shared)
    flops = 18 * st.routes * st.D * st.F
    base = {"shape": shape, "ep": 1, "routing": ROUTING, "precision": "bf16", "phase": "4-layer fwd+bwd",
            "layers": LAYERS, "tokens_per_rank": T, "shared_weights": shared, "GBps": None,
            "busiest_rank_rows": None, "balanced_rows": T * st.K}

    # The recipe: time, then the peak of one step, then its outputs for a numerics reference.
    r_ms = step_times(lambda: recipe_step(st), device, iters, warmup, before=st.zero_grads)
    st.zero_grads()
    marks = {}
    sync(device)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    r_peak = step_peak(lambda: recipe_step(st, marks), device)
    wgrad_temporary = st.E * 2 * st.F * st.D * 2
    r_act = None
    if r_peak is not None:
        r_act = max(marks["forward_end"] - before, r_peak - wgrad_temporary)
    y_ref, gx_ref, _ = recipe_step_outputs(st)
    if device == "cuda":
        torch.cuda.empty_cache()  # the contexts' cudaMalloc needs what torch cached for the recipe
    recipe_row = dict(base, impl="torch-native", budget=None, median_ms=r_ms[0], min_ms=r_ms[1],
                      max_ms=r_ms[2], useful_tflops=flops / r_ms[0] / 1e9, peak_mem_bytes=r_peak,
                      activation_peak_bytes=r_act, wgrad_temporary_bytes=wgrad_temporary,
                      forward_end_bytes=(marks["forward_end"] - before) if r_peak is not None else None)

    reference = None  # host copies of the full-save budget's outputs
    budget_rows = []
    for name, factor in BUDGETS:
        c = config(lib, st, factor)
        plan = epmoe_ctypes.plan_slots(lib, c)
        ctx = epmoe_ctypes.Context(lib, c, "cpu" if device == "cpu" else 0)
        try:
            held = ctx.memory_held()
            context_bytes = held["device_held_bytes"] + held["other_device_bytes"]
            # One kept step: the decisions and the outputs.
            keep = {"y": [], "grad_x": []}
            st.zero_grads()
            (_, _, grad_scores), saved = epmoe_step(ctx, st, keep)
            ctx.check()
            recomputed = sum(ctx.recomputes(s) for s in saved)
            out = outputs_of(st, keep, grad_scores)
            if name == "full save":
                reference = {k: v.detach().to("cpu", copy=True) for k, v in out.items()}
                err = {"y": rel_l2(keep["y"][-1], y_ref), "grad_x": rel_l2(keep["grad_x"][0], gx_ref)}
                recipe_row["rel_l2_epmoe_vs_recipe"] = err
            equal = name == "full save" or all(bitwise_equal(reference[k], v) for k, v in out.items())
            del keep, grad_scores, saved, out
            ms = step_times(lambda: epmoe_step(ctx, st), device, iters, warmup)
            peak = step_peak(lambda: epmoe_step(ctx, st), device)
            ctx.check()
            row = dict(base, impl="epmoe", budget=name, slot_capacity_factor=factor,
                       slot_bytes=plan["slot_bytes"], minimum_slot_bytes=plan["minimum_slot_bytes"],
                       balanced_full_save_slot_bytes=plan["balanced_full_save_slot_bytes"],
                       maximum_useful_slot_bytes=plan["maximum_useful_slot_bytes"],
                       slot_peak_bytes=ctx.slot_peak_bytes(0), recomputed_layers=recomputed,
                       median_ms=ms[0], min_ms=ms[1], max_ms=ms[2], useful_tflops=flops / ms[0] / 1e9,
                       step_alloc_peak_bytes=peak, arena_bytes=held["device_held_bytes"],
                       context_device_bytes=context_bytes,
                       peak_mem_bytes=None if peak is None else peak + context_bytes,
                       bitwise_equal_to_full_save=equal)
            budget_rows.append(row)
        finally:
            ctx.close()
        if device == "cuda":
            torch.cuda.empty_cache()
    gpu = device == "cuda"  # time and memory verdicts mean nothing on the CPU backend
    full = next(r for r in budget_rows if r["budget"] == "full save")
    default = next(r for r in budget_rows if r["budget"] == "default")
    for r in budget_rows:
        r["time_ratio_to_full_save"] = r["median_ms"] / full["median_ms"]
        r["time_ratio_to_recipe"] = r["median_ms"] / r_ms[0]
        r["ratio_to_recipe_peak"] = None if r_peak is None else r["peak_mem_bytes"] / r_peak
        r["ratio_to_recipe_activation_peak"] = None if r_act is None else r["peak_mem_bytes"] / r_act
    rows.extend(budget_rows + [recipe_row])

    minimum = next(r for r in budget_rows if r["budget"] == "minimum")
    targets.append({"shape": shape, "target": f"minimum budget: peak <= {MIN_PEAK_RATIO:.0%} of the recipe's",
                    "value": minimum["ratio_to_recipe_activation_peak"],
                    "met": None if r_act is None else minimum["ratio_to_recipe_activation_peak"] <= MIN_PEAK_RATIO})
    targets.append({"shape": shape, "target": f"minimum budget: step time <= {MIN_TIME_RATIO:.2f} x full save",
                    "value": minimum["time_ratio_to_full_save"],
                    "met": minimum["time_ratio_to_full_save"] <= MIN_TIME_RATIO if gpu else None})
    targets.append({"shape": shape, "target": "full-save budget: no recompute", "value": full["recomputed_layers"],
                    "met": full["recomputed_layers"] == 0})
    targets.append({"shape": shape, "target": f"full-save budget: step time <= {FULL_SAVE_TIME_RATIO:.2f} x "
                    "default (maximum useful, replay left out)",
                    "value": full["median_ms"] / default["median_ms"],
                    "met": full["median_ms"] / default["median_ms"] <= FULL_SAVE_TIME_RATIO if gpu else None})
    targets.append({"shape": shape, "target": "every budget bitwise equal to full save",
                    "value": all(r["bitwise_equal_to_full_save"] for r in budget_rows),
                    "met": all(r["bitwise_equal_to_full_save"] for r in budget_rows)})
    print_shape(shape, T, shared, budget_rows, recipe_row)
    del st, reference
    if device == "cuda":
        torch.cuda.empty_cache()


def recipe_step_outputs(st):
    """Final y and grad_x of layer 0 of one recipe step (numerics reference)."""
    st.zero_grads()
    y, gx, gs = recipe_step(st)
    st.zero_grads()
    return y, gx, gs


def mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def print_shape(shape, T, shared, budget_rows, recipe_row):
    print(f"\n{shape}: T = {T}, {LAYERS} layers, {'one shared weight set' if shared else 'own weights'}; "
          f"peak = step allocations above baseline + context device bytes (MiB)", flush=True)
    print(f"{'impl':13s} {'budget':10s} {'slot MiB':>9s} {'recomp':>6s} {'ms':>9s} {'x full':>6s} "
          f"{'peak MiB':>9s} {'x recipe':>8s} {'x r.act':>7s} {'bitwise':>7s}")
    print("  x full: step time / full save's; x recipe: peak / the recipe's peak; x r.act: peak / the "
          "recipe's peak less one w13-gradient temporary (the target's measure)")
    for r in budget_rows:
        ratio = r["ratio_to_recipe_peak"]
        act = r["ratio_to_recipe_activation_peak"]
        print(f"{'epmoe':13s} {r['budget']:10s} {mib(r['slot_bytes']):>9s} {r['recomputed_layers']:6d} "
              f"{r['median_ms']:9.3f} {r['time_ratio_to_full_save']:6.3f} {mib(r['peak_mem_bytes']):>9s} "
              f"{'-' if ratio is None else f'{ratio:.3f}':>8s} {'-' if act is None else f'{act:.3f}':>7s} "
              f"{str(r['bitwise_equal_to_full_save']):>7s}")
    r = recipe_row
    print(f"{'torch-native':13s} {'autograd':10s} {'-':>9s} {'-':>6s} {r['median_ms']:9.3f} {'':6s} "
          f"{mib(r['peak_mem_bytes']):>9s}   (less one w13-gradient temporary: {mib(r['activation_peak_bytes'])} "
          f"MiB; forward end {mib(r['forward_end_bytes'])} MiB)", flush=True)
    if "rel_l2_epmoe_vs_recipe" in r:
        print(f"epmoe (full save) vs recipe rel-L2: {r['rel_l2_epmoe_vs_recipe']}", flush=True)


def print_targets(targets):
    print("\ntargets:")
    for t in targets:
        v = t["value"]
        v = f"{v:.3f}" if isinstance(v, float) else str(v)
        verdict = "n/a (CPU)" if t["met"] is None else ("met" if t["met"] else "MISSED")
        print(f"  {t['shape']:14s} {t['target']:62s} {v:>8s}  {verdict}", flush=True)


def write_results(path, device, rows, targets):
    sha = os.environ.get("EPMOE_SHA") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    cuda = device == "cuda"
    out = {"sha": sha or "unknown", "date": datetime.date.today().isoformat(),
           "gpu": torch.cuda.get_device_name() if cuda else "cpu",
           "num_gpus": torch.cuda.device_count() if cuda else 0,
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                        "cutlass": "4.2.0.0"},
           "ceilings": {"bf16_matmul_tflops": None, "fp8_matmul_tflops": None, "peer_store_GBps": None},
           "benchmark": "slots", "rows": rows, "targets": targets}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=None, help="default: qwen3-30b-a3b,deepseek-v3 (--cpu: ci-tiny)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 10; --cpu 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --cpu 1)")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--cpu", action="store_true", help="CPU backend and host tensors: a smoke check")
    ap.add_argument("--shared-weights", action="store_true",
                    help="one weight set for all layers (chosen anyway where per-layer sets do not fit)")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_slots: no CUDA device (use --cpu for the CPU smoke check)")
    shapes = (args.shapes or ("ci-tiny" if args.cpu else "qwen3-30b-a3b,deepseek-v3")).split(",")
    iters = args.iters or (2 if args.cpu else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 3)
    lib = epmoe_ctypes.load(args.lib)
    rows, targets = [], []
    for shape in shapes:
        bench_shape(lib, shape, device, iters, warmup, rows, targets, args.shared_weights)
        write_results(args.out, device, rows, targets)  # after every shape: a crash keeps what ran
    print_targets(targets)
    return rows, targets


if __name__ == "__main__":
    main()
