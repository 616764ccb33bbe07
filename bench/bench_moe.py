"""Benchmark of the routed experts at EP = 1 on one GPU (MEASURE.md): epmoe against the torch-native
recipe in the same process on the same inputs, the dense-matmul ceiling and the HBM copy ceiling
measured in the same run, per-stage breakdown, grouped GEMM alone, decode against the roofline.

    python3 bench/bench_moe.py --out results.json [--shapes a,b] [--routings balanced,skew]

Each shape also gets epmoe-fp8 rows (fp8_block inference forward with prepared weights, train T
and decode T; fp8_block training fwd+bwd with prepared weights at train T) beside the bf16 rows,
and torch-native-fp8 rows (torch_recipe_fp8.py: the recipe on torch._scaled_grouped_mm, row-wise
scales, weights quantized once) for fwd, fwd+bwd and decode-fwd; both rel-L2 against epmoe's bf16
outputs on the same inputs. The epmoe-fp8 fwd+bwd rows run the default Config.fp8_wgrad (by_shape)
and record the planner's choice (fp8_wgrad: "fp8" or "bf16", epmoe_resolved_fp8_wgrad); beside
them an epmoe-fp8-wgrad-bf16 or epmoe-fp8-wgrad-fp8 fwd+bwd row with a stage breakdown forces the
other choice (bf16: both weight gradients as bf16 WGRADs, x decoded from its E4M3 rows; fp8: the
FP8 WGRADs), with ratio_to_fp8 against the epmoe-fp8 fwd+bwd row. --no-fp8 leaves all of them
out; where torch._scaled_grouped_mm does not run the row-wise recipe the torch-native-fp8 rows
are left out with the reason printed and kept under "notes" in the JSON. The epmoe fwd+bwd rows
(bf16, epmoe-fp8*, --epmoe-only's) record "kernels": explain_cuda_kernels' text, the kernel each
grouped GEMM ran and the rule or override that chose it.

Each shape also gets epmoe-nvfp4 / epmoe-nvfp4-graph decode-fwd rows (Config.precision = nvfp4:
weight-only inference on weights prepared once) with roofline_fraction for the bytes the NVFP4
forward reads (codes, block scales, globals of the experts it touches, and the activation rows its
GEMMs read), ratio_to_bf16 against the epmoe bf16 decode row of the same shape (eager vs eager,
graph vs graph) and y's rel-L2 against it. --no-nvfp4 leaves them out; --nvfp4-only times the bf16
decode rows and these alone. EPMOE_NVFP4_SPLITK=<n> in the environment forces the NVFP4 GEMMs' K
splits (unset: one; auto: the heuristic; docs/formats.md "Split-K"); the rows record it (nvfp4_splitk).

Each shape also gets epmoe-mxfp8 rows (Config.precision = mxfp8: MXFP8 inference on weights
prepared once, activation rows quantized 1x32 before each GEMM): decode-fwd (and -graph) beside the
bf16 decode rows and fwd at train T (prefill) beside the bf16 fwd row, with ratio_to_bf16 and y's
rel-L2 against the bf16 rows' y on the same inputs. --no-mxfp8 leaves them out; --mxfp8-only times
the bf16 decode and fwd rows and these alone. The rows record the MXFP8 GEMM kernel the library
picks (mxfp8_kernel: decode or wgmma; mxfp8_kernel_for in src/cuda/mxfp8_forward.h: wgmma when the
capacity rows M >= 16 E, EPMOE_MXFP8_KERNEL=decode|wgmma|auto overrides it).
"""
import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import epmoe_ctypes  # noqa: E402
import shapes as S  # noqa: E402
from measure import ceilings, rel_l2, timed  # noqa: E402
import torch_recipe  # noqa: E402
import torch_recipe_fp8  # noqa: E402


# Config.scratch_device_bytes of every epmoe context (--scratch-device-bytes; -1: all device).
SCRATCH_DEVICE_BYTES = -1

class Layer:
    """Inputs, outputs and an epmoe context for one shape and routing at EP = 1."""

    def __init__(self, lib, shape, routing, T, seed=0, fused=True, precision="bf16",
                 fp8_wgrad=None):
        """precision "fp8": an fp8_block inference context (forward only) with the weights
        prepared once (epmoe_prepare_weights_fp8), as an inference server holds them;
        "fp8-train": an fp8_block training context with prepared weights (forward + backward),
        Config.fp8_wgrad as fp8_wgrad forces it ("fp8" or "bf16"; None: the default, by_shape;
        self.fp8_wgrad: the planner's choice);
        "nvfp4": weight-only NVFP4 inference on weights prepared once (epmoe_prepare_weights_nvfp4);
        "mxfp8": MXFP8 inference on weights prepared once (epmoe_prepare_weights_mxfp8)."""
        D, F, E, K, _, _ = S.SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.D, self.F, self.E, self.K, self.T = D, F, E, K, T
        self.x = (torch.randn(T, D, device="cuda", generator=g)).to(torch.bfloat16)
        self.w13 = (torch.randn(E, 2 * F, D, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16)
        self.w2 = (torch.randn(E, D, F, device="cuda", generator=g) / F ** 0.5).to(torch.bfloat16)
        self.ids, self.scores = S.route(routing, T, E, K, generator=g)
        self.grad_y = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        self.y = torch.empty_like(self.x)
        self.prepared = None
        cfg = lib.epmoe_config_default(T, D, F, K, E)
        self.capacity_factor = cfg.capacity_factor
        cfg.fuse_epilogues = int(fused)
        cfg.scratch_device_bytes = SCRATCH_DEVICE_BYTES
        self.inference = precision in ("fp8", "nvfp4", "mxfp8")
        if precision == "mxfp8":
            cfg.precision, cfg.inference, cfg.prepared_weights = 2, 1, 1
            self.prepared = (epmoe_ctypes.PreparedMxfp8(lib, self.w13),
                             epmoe_ctypes.PreparedMxfp8(lib, self.w2))
        if precision == "nvfp4":
            cfg.precision, cfg.inference, cfg.prepared_weights = 3, 1, 1
            self.prepared = (epmoe_ctypes.PreparedNvfp4(lib, self.w13),
                             epmoe_ctypes.PreparedNvfp4(lib, self.w2))
        if precision in ("fp8", "fp8-train"):
            cfg.precision, cfg.inference, cfg.prepared_weights = 1, int(self.inference), 1
            if fp8_wgrad is not None:
                cfg.fp8_wgrad = epmoe_ctypes.FP8_WGRADS.index(fp8_wgrad)
            self.fp8_wgrad = epmoe_ctypes.resolved_fp8_wgrad(lib, cfg, 1)
            t = not self.inference  # a backward reads the transposed copies
            self.prepared = (epmoe_ctypes.PreparedFp8(lib, self.w13, transposed=t),
                             epmoe_ctypes.PreparedFp8(lib, self.w2, transposed=t))
        # The kernel each GEMM runs, with this process's overrides (the JSON's "kernels").
        self.kernels = epmoe_ctypes.explain_kernels(lib, cfg, 1)
        if not self.inference:
            self.grad_x = torch.empty_like(self.x)
            self.grad_scores = torch.empty(T, K, device="cuda")
            self.grad_w13 = torch.empty_like(self.w13)
            self.grad_w2 = torch.empty_like(self.w2)
        self.ctx = epmoe_ctypes.Context(lib, cfg)
        self.routes = S.useful_routes(self.ids)

    def forward(self, save=True):
        return self.ctx.forward(self.x, self.ids, self.scores, self.w13, self.w2, self.y,
                                save=save and not self.inference, prepared=self.prepared)

    def step(self):
        saved = self.forward(True)
        self.ctx.backward(saved, self.grad_y, self.ids, self.scores, self.w13, self.w2, self.grad_x,
                          self.grad_scores, self.grad_w13, self.grad_w2, prepared=self.prepared)

    def close(self):
        self.ctx.close()


def recipe_step(layer, backward):
    x = layer.x.detach().requires_grad_(backward)
    w13 = layer.w13.detach().requires_grad_(backward)
    w2 = layer.w2.detach().requires_grad_(backward)
    scores = layer.scores.detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        y = torch_recipe.moe_forward(x, layer.ids, scores, w13, w2)
        if backward:
            y.backward(layer.grad_y)
    return y, x, scores, w13, w2


def decode_times(layer, iters):
    """Decode forward of `layer`: eager and CUDA-graph replay times, and the experts it touches."""
    t_dec = timed(lambda: layer.forward(False), max(iters, 20))
    graph = torch.cuda.CUDAGraph()
    layer.forward(False)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        layer.forward(False)
    t_dec_graph = timed(graph.replay, max(iters, 20))
    active = int(torch.unique(layer.ids[layer.ids >= 0]).numel())
    return t_dec, t_dec_graph, active


def recipe_fp8_step(layer, prepared, backward):
    """torch-native-fp8 forward (and backward) on the layer's inputs; prepared: the weights'
    torch_recipe_fp8.quantize_weights, made once outside the timing."""
    x = layer.x.detach().requires_grad_(backward)
    w13 = layer.w13.detach().requires_grad_(backward)
    w2 = layer.w2.detach().requires_grad_(backward)
    scores = layer.scores.detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        y = torch_recipe_fp8.moe_forward(x, layer.ids, scores, w13, w2, prepared)
        if backward:
            y.backward(layer.grad_y)
    return y, x, scores


def prepare_recipe_fp8(layer):
    return (torch_recipe_fp8.quantize_weights(layer.w13), torch_recipe_fp8.quantize_weights(layer.w2))


# What the torch-native-fp8 rows ran, recorded in each of them.
RECIPE_FP8_META = {
    "fp8_scaling": "e4m3, row-wise fp32 scales (amax/448): per grouped activation row, quantized "
                   "per call by one torch.compile'd kernel; per output channel of each expert "
                   "weight, prepared once",
    "fwd_gemms": "torch._scaled_grouped_mm (use_fast_accum=True)",
    "bwd_gemms": torch_recipe_fp8.BACKWARD_GEMMS}

# Why the torch-native-fp8 rows are missing, where they are (the JSON's "notes").
NOTES = []


def bench_recipe_fp8(L, shape, routing, ceil, rows, iters, y_bf16, bf16_out):
    """torch-native-fp8 fwd and fwd+bwd at train T on L's inputs (the bf16 rows' inputs); rel-L2
    against epmoe's bf16 outputs y_bf16 / bf16_out, as the epmoe-fp8 rows. Returns the times by
    phase."""
    D, F = L.D, L.F
    N = L.routes
    prepared = prepare_recipe_fp8(L)
    y = recipe_fp8_step(L, prepared, False)[0]
    err_fwd = {"y": rel_l2(y, y_bf16)}
    y, x, s = recipe_fp8_step(L, prepared, True)
    err_step = {"y": rel_l2(y, bf16_out["y"]), "grad_x": rel_l2(x.grad, bf16_out["grad_x"]),
                "grad_scores": rel_l2(s.grad, bf16_out["grad_scores"])}
    del y, x, s
    t_fwd = timed(lambda: recipe_fp8_step(L, prepared, False), iters)
    t_step = timed(lambda: recipe_fp8_step(L, prepared, True), iters)
    fp8_ceil = ceil.get("fp8_matmul_tflops")
    fwd_flops, step_flops = 6 * N * D * F, 18 * N * D * F
    rows.append(row("torch-native-fp8", shape, routing, "fwd", L.T, t_fwd, fwd_flops, precision="fp8",
                    rel_l2_vs_bf16=err_fwd,
                    ratio_to_ceiling=(fwd_flops / t_fwd[0] / 1e9 / fp8_ceil) if fp8_ceil else None,
                    **RECIPE_FP8_META))
    rows.append(row("torch-native-fp8", shape, routing, "fwd+bwd", L.T, t_step, step_flops,
                    precision="fp8", rel_l2_vs_bf16=err_step, **RECIPE_FP8_META))
    print(f"{shape} {routing} torch-native-fp8 fwd {t_fwd[0]:.3f} ms, fwd+bwd {t_step[0]:.3f} ms; "
          f"rel-L2 vs bf16 fwd y {err_fwd['y']:.3e}, fwd+bwd " +
          ", ".join(f"{k} {v:.3e}" for k, v in err_step.items()), flush=True)
    del prepared
    torch.cuda.empty_cache()
    return {"fwd": t_fwd, "fwd+bwd": t_step}


def bench_recipe_fp8_decode(Ld, shape, routing, ceil, rows, iters):
    """torch-native-fp8 decode forward at decode T on Ld's inputs, against the HBM roofline of the
    e4m3 expert weights it reads. Returns its times."""
    prepared = prepare_recipe_fp8(Ld)
    t = timed(lambda: recipe_fp8_step(Ld, prepared, False), max(iters, 20))
    active = int(torch.unique(Ld.ids[Ld.ids >= 0]).numel())
    weight_bytes = active * 3 * Ld.D * Ld.F  # E4M3 (scales: 4 bytes per output channel)
    rows.append(row("torch-native-fp8", shape, routing, "decode-fwd", Ld.T, t,
                    6 * Ld.routes * Ld.D * Ld.F, GBps=weight_bytes / t[0] / 1e6, precision="fp8",
                    roofline_fraction=weight_bytes / (ceil["hbm_copy_GBps"] * 1e6) / t[0],
                    weight_bytes=weight_bytes, **RECIPE_FP8_META))
    del prepared
    torch.cuda.empty_cache()
    return t


def ratio_to(recipe_ms, phase, t):
    """recipe median / epmoe median for phase, None where the recipe did not run."""
    r = (recipe_ms or {}).get(phase)
    return r[0] / t[0] if r else None


def row(impl, shape, routing, phase, T, ms, flops=None, GBps=None, **extra):
    med, lo, hi = ms
    r = {"impl": impl, "shape": shape, "ep": 1, "routing": routing, "precision": "bf16",
         "phase": phase, "tokens_per_rank": T, "median_ms": med, "min_ms": lo, "max_ms": hi,
         "useful_tflops": (flops / med / 1e9) if flops else None, "GBps": GBps,
         "busiest_rank_rows": None, "balanced_rows": None, "peak_mem_bytes": None}
    r.update(extra)
    return r


def stage_times(layer, steps=3, fn=None):
    """Stage -> list of ms over `steps` forward + backward steps, or calls of fn (stages
    serialised by syncs)."""
    layer.ctx.stage_timing(True)
    stage_ms = {}
    for _ in range(steps):
        (fn or layer.step)()
        for name, ms in layer.ctx.stage_times():
            stage_ms.setdefault(name, []).append(ms)
    layer.ctx.stage_timing(False)
    return stage_ms


def bench_epmoe_only(lib, shape, routing, rows, iters, impl, precision="bf16"):
    """epmoe alone (no recipe): fwd, fwd+bwd and the stage breakdown, e.g. under another
    EPMOE_GEMM_SCHEDULE in a separate process; precision "bf16" or "fp8-train" (an fp8_block
    training context with prepared weights, as the epmoe-fp8 fwd+bwd rows)."""
    D, F, E, K, T_train, _ = S.SHAPES[shape]
    L = Layer(lib, shape, routing, T_train, precision=precision)
    p = "fp8" if precision == "fp8-train" else "bf16"
    extra = {"fp8_wgrad": L.fp8_wgrad} if p == "fp8" else {}  # the planner's choice (by_shape)
    extra["kernels"] = L.kernels
    N = L.routes
    L.step()
    L.ctx.check()
    t_fwd = timed(lambda: L.forward(False), iters)
    t_step = timed(L.step, iters)
    rows.append(row(impl, shape, routing, "fwd", T_train, t_fwd, 6 * N * D * F, precision=p,
                    **extra))
    rows.append(row(impl, shape, routing, "fwd+bwd", T_train, t_step, 18 * N * D * F, precision=p,
                    **extra))
    stage_ms = stage_times(L)
    breakdown = {k: statistics.median(v) for k, v in stage_ms.items()}
    rows.append({"impl": impl, "shape": shape, "ep": 1, "routing": routing, "precision": p,
                 "phase": "stage-breakdown", "tokens_per_rank": T_train, "stages_ms": breakdown})
    print(f"{shape} {routing} {impl} fwd {t_fwd[0]:.3f} ms, fwd+bwd {t_step[0]:.3f} ms "
          f"({18 * N * D * F / t_step[0] / 1e9:.0f} TFLOP/s); stages: " +
          ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items()), flush=True)
    L.close()
    del L
    torch.cuda.empty_cache()
    return {}


def bench_fp8_forward(lib, shape, routing, ceil, rows, iters, y_bf16, t_fwd_bf16, recipe_ms=None):
    """epmoe-fp8: the fp8_block forward of an inference context with prepared weights, on the
    inputs of the bf16 rows (same seed); useful FLOPs as bf16 (MEASURE.md). y_bf16 / t_fwd_bf16:
    the bf16 forward's output and times, for the error and the speed-up; recipe_ms: the
    torch-native-fp8 times by phase (ratio_to_recipe), None where it did not run."""
    D, F, E, K, T_train, T_decode = S.SHAPES[shape]
    L = Layer(lib, shape, routing, T_train, precision="fp8")
    N = L.routes
    L.forward(False)
    L.ctx.check()
    err = rel_l2(L.y, y_bf16)
    t = timed(lambda: L.forward(False), iters)
    flops = 6 * N * D * F
    fp8_ceil = ceil.get("fp8_matmul_tflops")
    rows.append(row("epmoe-fp8", shape, routing, "fwd", T_train, t, flops, precision="fp8",
                    ratio_to_bf16=t_fwd_bf16[0] / t[0], rel_l2_vs_bf16={"y": err},
                    ratio_to_ceiling=(flops / t[0] / 1e9 / fp8_ceil) if fp8_ceil else None,
                    ratio_to_recipe=ratio_to(recipe_ms, "fwd", t)))
    stage_ms = stage_times(L, fn=lambda: L.forward(False))
    breakdown = {k: statistics.median(v) for k, v in stage_ms.items()}
    rows.append({"impl": "epmoe-fp8", "shape": shape, "ep": 1, "routing": routing, "precision": "fp8",
                 "phase": "stage-breakdown-fwd", "tokens_per_rank": T_train, "stages_ms": breakdown})
    print(f"{shape} {routing} fp8 fwd {t[0]:.3f} ms ({flops / t[0] / 1e9:.0f} TFLOP/s, "
          f"x{t_fwd_bf16[0] / t[0]:.2f} vs bf16), y rel-L2 vs bf16 {err:.3e}; stages (ms): " +
          ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items()), flush=True)
    L.close()
    del L
    torch.cuda.empty_cache()

    Ld = Layer(lib, shape, routing, T_decode, seed=1, precision="fp8")
    t_dec, t_dec_graph, active = decode_times(Ld, iters)
    weight_bytes = active * 3 * D * F  # E4M3 (scales: 4 bytes per 128x128 block, negligible)
    for impl, td in (("epmoe-fp8", t_dec), ("epmoe-fp8-graph", t_dec_graph)):
        rows.append(row(impl, shape, routing, "decode-fwd", T_decode, td, 6 * Ld.routes * D * F,
                        GBps=weight_bytes / td[0] / 1e6, precision="fp8",
                        roofline_fraction=weight_bytes / (ceil["hbm_copy_GBps"] * 1e6) / td[0],
                        weight_bytes=weight_bytes, ratio_to_recipe=ratio_to(recipe_ms, "decode-fwd", td)))
    Ld.close()
    del Ld
    torch.cuda.empty_cache()


def bench_bf16_decode(lib, shape, routing, ceil, rows, iters):
    """The epmoe / epmoe-graph bf16 decode-fwd rows alone (--nvfp4-only). Returns (eager times,
    graph times, y)."""
    D, F, E, K, _, T_decode = S.SHAPES[shape]
    Ld = Layer(lib, shape, routing, T_decode, seed=1)
    t_dec, t_dec_graph, active = decode_times(Ld, iters)
    weight_bytes = active * 3 * D * F * 2
    for impl, t in (("epmoe", t_dec), ("epmoe-graph", t_dec_graph)):
        rows.append(row(impl, shape, routing, "decode-fwd", T_decode, t, 6 * Ld.routes * D * F,
                        GBps=weight_bytes / t[0] / 1e6,
                        roofline_fraction=weight_bytes / (ceil["hbm_copy_GBps"] * 1e6) / t[0],
                        weight_bytes=weight_bytes))
    Ld.forward(False)
    y = Ld.y.clone()
    Ld.close()
    del Ld
    torch.cuda.empty_cache()
    return t_dec, t_dec_graph, y


def bench_nvfp4_decode(lib, shape, routing, ceil, rows, iters, bf16_dec, bf16_dec_graph, y_bf16):
    """epmoe-nvfp4: the weight-only NVFP4 decode forward (weights prepared once) on the inputs of
    the bf16 decode rows (same seed); bf16_dec / bf16_dec_graph / y_bf16: that row's times and y
    (ratio_to_bf16, rel-L2). Bytes read: the touched experts' codes, block scales and globals, and
    the activation rows the two GEMMs read (x rows [routes, D], h rows [routes, F], bf16)."""
    D, F, E, K, _, T_decode = S.SHAPES[shape]
    Ln = Layer(lib, shape, routing, T_decode, seed=1, precision="nvfp4")
    Ln.forward(False)
    Ln.ctx.check()
    err = rel_l2(Ln.y, y_bf16)
    t_dec, t_dec_graph, active = decode_times(Ln, iters)
    per_expert = sum(p.nbytes() for p in Ln.prepared) // E
    # The GEMMs' K-split count: EPMOE_NVFP4_SPLITK as set for this process (None: one split).
    splitk = os.environ.get("EPMOE_NVFP4_SPLITK") or None
    weight_bytes = active * per_expert
    read_bytes = weight_bytes + Ln.routes * (D + F) * 2
    for impl, t, ref in (("epmoe-nvfp4", t_dec, bf16_dec),
                         ("epmoe-nvfp4-graph", t_dec_graph, bf16_dec_graph)):
        rows.append(row(impl, shape, routing, "decode-fwd", T_decode, t, 6 * Ln.routes * D * F,
                        GBps=read_bytes / t[0] / 1e6, precision="nvfp4",
                        roofline_fraction=read_bytes / (ceil["hbm_copy_GBps"] * 1e6) / t[0],
                        weight_bytes=weight_bytes, read_bytes=read_bytes,
                        ratio_to_bf16=ref[0] / t[0], rel_l2_vs_bf16={"y": err},
                        nvfp4_splitk=splitk))
        print(f"{shape} {routing} {impl} decode-fwd {t[0]:.4f} ms, x{ref[0] / t[0]:.2f} vs bf16, "
              f"{100 * read_bytes / (ceil['hbm_copy_GBps'] * 1e6) / t[0]:.0f}% of HBM roofline "
              f"({read_bytes / 1e6:.1f} MB read), y rel-L2 vs bf16 {err:.3e}, "
              f"EPMOE_NVFP4_SPLITK={splitk or 'heuristic'}", flush=True)
    Ln.close()
    del Ln
    torch.cuda.empty_cache()


def bench_bf16_fwd(lib, shape, routing, ceil, rows, iters):
    """The epmoe bf16 fwd row at train T alone (--mxfp8-only). Returns (times, y)."""
    D, F, E, K, T_train, _ = S.SHAPES[shape]
    L = Layer(lib, shape, routing, T_train)
    L.forward(False)
    L.ctx.check()
    t = timed(lambda: L.forward(False), iters)
    flops = 6 * L.routes * D * F
    rows.append(row("epmoe", shape, routing, "fwd", T_train, t, flops,
                    ratio_to_ceiling=flops / t[0] / 1e9 / ceil["bf16_matmul_tflops"]))
    L.forward(False)
    y = L.y.clone()
    L.close()
    del L
    torch.cuda.empty_cache()
    return t, y


def mxfp8_kernel(layer):
    """The MXFP8 GEMM kernel the library runs for `layer` ("decode" or "wgmma"): cuda::mxfp8_kernel_for's
    choice as explain_cuda_kernels names it (layer.kernels)."""
    found = re.search(r"mxfp8 (decode|wgmma) kernel", layer.kernels)
    if found is None:
        raise RuntimeError(f"no MXFP8 kernel in the kernels text:\n{layer.kernels}")
    return found.group(1)


def bench_mxfp8(lib, shape, routing, ceil, rows, iters, bf16_dec, bf16_dec_graph, y_dec,
                bf16_fwd, y_fwd):
    """epmoe-mxfp8: the MXFP8 inference forward (weights prepared once) at decode T (eager and
    graph) and at train T (prefill), on the inputs of the bf16 rows (same seeds); bf16_dec /
    bf16_dec_graph / y_dec and bf16_fwd / y_fwd: those rows' times and y (ratio_to_bf16, rel-L2).
    Decode bytes read: the touched experts' codes and scales, and the activation rows the two GEMMs
    read (x rows [routes, D], h rows [routes, F], bf16, and their E4M3 codes and E8M0 scales)."""
    D, F, E, K, T_train, T_decode = S.SHAPES[shape]
    Ld = Layer(lib, shape, routing, T_decode, seed=1, precision="mxfp8")
    Ld.forward(False)
    Ld.ctx.check()
    err = rel_l2(Ld.y, y_dec)
    t_dec, t_dec_graph, active = decode_times(Ld, iters)
    weight_bytes = active * (sum(p.nbytes() for p in Ld.prepared) // E)
    read_bytes = weight_bytes + Ld.routes * (D + F) * (2 + 1 + 1 / 32)
    for impl, t, ref in (("epmoe-mxfp8", t_dec, bf16_dec),
                         ("epmoe-mxfp8-graph", t_dec_graph, bf16_dec_graph)):
        rows.append(row(impl, shape, routing, "decode-fwd", T_decode, t, 6 * Ld.routes * D * F,
                        GBps=read_bytes / t[0] / 1e6, precision="mxfp8",
                        roofline_fraction=read_bytes / (ceil["hbm_copy_GBps"] * 1e6) / t[0],
                        weight_bytes=weight_bytes, read_bytes=read_bytes,
                        ratio_to_bf16=ref[0] / t[0], rel_l2_vs_bf16={"y": err},
                        mxfp8_kernel=mxfp8_kernel(Ld)))
        print(f"{shape} {routing} {impl} decode-fwd {t[0]:.4f} ms, x{ref[0] / t[0]:.2f} vs bf16, "
              f"{100 * read_bytes / (ceil['hbm_copy_GBps'] * 1e6) / t[0]:.0f}% of HBM roofline "
              f"({read_bytes / 1e6:.1f} MB read), y rel-L2 vs bf16 {err:.3e}, "
              f"kernel {mxfp8_kernel(Ld)}", flush=True)
    Ld.close()
    del Ld
    torch.cuda.empty_cache()
    L = Layer(lib, shape, routing, T_train, precision="mxfp8")
    L.forward(False)
    L.ctx.check()
    err = rel_l2(L.y, y_fwd)
    t = timed(lambda: L.forward(False), iters)
    flops = 6 * L.routes * D * F
    kernel = mxfp8_kernel(L)
    rows.append(row("epmoe-mxfp8", shape, routing, "fwd", T_train, t, flops, precision="mxfp8",
                    ratio_to_bf16=bf16_fwd[0] / t[0], rel_l2_vs_bf16={"y": err},
                    mxfp8_kernel=kernel))
    print(f"{shape} {routing} epmoe-mxfp8 fwd (T {T_train}) {t[0]:.3f} ms "
          f"({flops / t[0] / 1e9:.0f} TFLOP/s, x{bf16_fwd[0] / t[0]:.2f} vs bf16), "
          f"y rel-L2 vs bf16 {err:.3e}, kernel {kernel}", flush=True)
    L.close()
    del L
    torch.cuda.empty_cache()


def bench_fp8_train(lib, shape, routing, rows, iters, bf16_out, t_step_bf16, recipe_ms=None,
                    force_wgrad=None, t_step_fp8=None):
    """epmoe-fp8 fwd+bwd: an fp8_block training context with prepared weights (prepared once, as
    an optimizer step would refill them) at training T, on the inputs of the bf16 rows; useful
    FLOPs as bf16. bf16_out: the bf16 step's y, grad_x, grad_scores (errors); t_step_bf16 its
    times; recipe_ms: the torch-native-fp8 times by phase, None where it did not run.
    force_wgrad None: the default Config.fp8_wgrad (by_shape), the epmoe-fp8 rows; "fp8" or
    "bf16": that choice forced, the epmoe-fp8-wgrad-<choice> rows, with ratio_to_fp8 against
    t_step_fp8 (the epmoe-fp8 fwd+bwd times). Every row records the choice the context ran
    (fp8_wgrad, from the planner). Returns the times and that choice."""
    D, F, E, K, T_train, _ = S.SHAPES[shape]
    impl = "epmoe-fp8" if force_wgrad is None else f"epmoe-fp8-wgrad-{force_wgrad}"
    L = Layer(lib, shape, routing, T_train, precision="fp8-train", fp8_wgrad=force_wgrad)
    N = L.routes
    L.step()
    L.ctx.check()
    err = {name: rel_l2(getattr(L, name), ref) for name, ref in bf16_out.items()}
    t = timed(L.step, iters)
    flops = 18 * N * D * F
    extra = {"fp8_wgrad": L.fp8_wgrad, "kernels": L.kernels}
    if t_step_fp8 is not None:
        extra["ratio_to_fp8"] = t_step_fp8[0] / t[0]
    rows.append(row(impl, shape, routing, "fwd+bwd", T_train, t, flops, precision="fp8",
                    ratio_to_bf16=t_step_bf16[0] / t[0], rel_l2_vs_bf16=err,
                    ratio_to_recipe=ratio_to(recipe_ms, "fwd+bwd", t), **extra))
    stage_ms = stage_times(L)
    breakdown = {k: statistics.median(v) for k, v in stage_ms.items()}
    rows.append({"impl": impl, "shape": shape, "ep": 1, "routing": routing, "precision": "fp8",
                 "phase": "stage-breakdown", "tokens_per_rank": T_train, "stages_ms": breakdown,
                 **extra})
    print(f"{shape} {routing} {impl} (fp8_wgrad {L.fp8_wgrad}) fwd+bwd {t[0]:.3f} ms "
          f"({flops / t[0] / 1e9:.0f} TFLOP/s, "
          f"x{t_step_bf16[0] / t[0]:.2f} vs bf16" +
          (f", x{t_step_fp8[0] / t[0]:.2f} vs epmoe-fp8" if t_step_fp8 is not None else "") +
          "), rel-L2 vs bf16 " +
          ", ".join(f"{k} {v:.3e}" for k, v in err.items()) + "; stages (ms): " +
          ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items()), flush=True)
    wgrad = L.fp8_wgrad
    L.close()
    del L
    torch.cuda.empty_cache()
    return t, wgrad


def bench_shape(lib, shape, routing, ceil, rows, iters, fp8=True, fp8_recipe=True, nvfp4=True,
                mxfp8=True):
    """fp8: the epmoe-fp8 rows; fp8_recipe: the torch-native-fp8 rows (with fp8 only); nvfp4: the
    epmoe-nvfp4 decode rows; mxfp8: the epmoe-mxfp8 decode and fwd rows."""
    D, F, E, K, T_train, T_decode = S.SHAPES[shape]
    L = Layer(lib, shape, routing, T_train)
    N = L.routes
    L.rows = N
    fwd_flops, step_flops = 6 * N * D * F, 18 * N * D * F
    # correctness against the recipe on these inputs
    L.step()
    L.ctx.check()
    y_ref, x_ref, s_ref, w13_ref, w2_ref = recipe_step(L, True)
    err = {"y": rel_l2(L.y, y_ref), "grad_x": rel_l2(L.grad_x, x_ref.grad),
           "grad_scores": rel_l2(L.grad_scores, s_ref.grad), "grad_w13": rel_l2(L.grad_w13, w13_ref.grad),
           "grad_w2": rel_l2(L.grad_w2, w2_ref.grad)}
    del y_ref, x_ref, s_ref, w13_ref, w2_ref
    torch.cuda.empty_cache()

    t_fwd = timed(lambda: L.forward(False), iters)
    t_step = timed(L.step, iters)
    L.step()
    # the epmoe-fp8 fwd+bwd row's reference (same inputs)
    bf16_out = {"y": L.y.clone(), "grad_x": L.grad_x.clone(), "grad_scores": L.grad_scores.clone()}
    L.forward(False)
    y_bf16 = L.y.clone()  # the epmoe-fp8 rows' reference (same inputs)
    torch.cuda.reset_peak_memory_stats()
    r_fwd = timed(lambda: recipe_step(L, False), iters)
    r_step = timed(lambda: recipe_step(L, True), iters)
    recipe_peak = torch.cuda.max_memory_allocated()
    recipe_fp8_ms = None
    if fp8 and fp8_recipe:
        try:
            recipe_fp8_ms = bench_recipe_fp8(L, shape, routing, ceil, rows, iters, y_bf16, bf16_out)
        except (RuntimeError, TypeError, NotImplementedError, ValueError) as e:  # e.g. out of memory
            note = f"{shape} {routing}: torch-native-fp8 fwd / fwd+bwd rows left out: {e}"
            print(note, flush=True)
            NOTES.append(note)
            torch.cuda.empty_cache()
    ext = {"rel_l2_vs_recipe": err}
    rows.append(row("epmoe", shape, routing, "fwd", T_train, t_fwd, fwd_flops,
                    ratio_to_ceiling=fwd_flops / t_fwd[0] / 1e9 / ceil["bf16_matmul_tflops"],
                    ratio_to_recipe=r_fwd[0] / t_fwd[0], **ext))
    rows.append(row("epmoe", shape, routing, "fwd+bwd", T_train, t_step, step_flops,
                    ratio_to_ceiling=step_flops / t_step[0] / 1e9 / ceil["bf16_matmul_tflops"],
                    ratio_to_recipe=r_step[0] / t_step[0], kernels=L.kernels))
    rows.append(row("torch-native", shape, routing, "fwd", T_train, r_fwd, fwd_flops))
    rows.append(row("torch-native", shape, routing, "fwd+bwd", T_train, r_step, step_flops,
                    peak_mem_bytes_recipe=recipe_peak))

    # per-stage breakdown (stages serialised by device syncs)
    stage_ms = stage_times(L)
    breakdown = {k: statistics.median(v) for k, v in stage_ms.items()}
    rows.append({"impl": "epmoe", "shape": shape, "ep": 1, "routing": routing, "precision": "bf16",
                 "phase": "stage-breakdown", "tokens_per_rank": T_train, "stages_ms": breakdown})
    print(f"{shape} {routing} stages (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items()),
          flush=True)

    # grouped GEMM alone: torch._grouped_mm on the same grouped rows vs our GEMM stages
    order, dst, offs, padded = torch_recipe.permute(L.ids, E)
    xp = torch.randn(padded, D, device="cuda").to(torch.bfloat16)
    hp = torch.randn(padded, F, device="cuda").to(torch.bfloat16)
    g13 = timed(lambda: torch._grouped_mm(xp, L.w13.transpose(-2, -1), offs=offs), iters)
    g2 = timed(lambda: torch._grouped_mm(hp, L.w2.transpose(-2, -1), offs=offs), iters)
    gemm_flops_13, gemm_flops_2 = 4 * N * D * F, 2 * N * D * F
    rows.append(row("torch._grouped_mm", shape, routing, "grouped-gemm-w13", T_train, g13, gemm_flops_13))
    rows.append(row("torch._grouped_mm", shape, routing, "grouped-gemm-w2", T_train, g2, gemm_flops_2))
    for name, flops, ref in (("w13_swiglu", gemm_flops_13, g13), ("w2_scatter", gemm_flops_2, g2)):
        if name in stage_ms:
            v = stage_ms[name]
            ms = (statistics.median(v), min(v), max(v))
            rows.append(row("epmoe", shape, routing, "grouped-gemm-" + name.split("_")[0], T_train, ms,
                            flops, ratio_to_grouped_mm=ref[0] / ms[0], includes_epilogue=name))
    del xp, hp
    L.close()
    del L
    torch.cuda.empty_cache()

    # decode forward at T_decode: against the HBM roofline of the expert weights it reads
    Ld = Layer(lib, shape, routing, T_decode, seed=1)
    t_dec, t_dec_graph, active = decode_times(Ld, iters)
    weight_bytes = active * 3 * D * F * 2
    roofline_ms = weight_bytes / (ceil["hbm_copy_GBps"] * 1e6)
    for impl, t in (("epmoe", t_dec), ("epmoe-graph", t_dec_graph)):
        rows.append(row(impl, shape, routing, "decode-fwd", T_decode, t,
                        6 * Ld.routes * D * F, GBps=weight_bytes / t[0] / 1e6,
                        roofline_fraction=roofline_ms / t[0], weight_bytes=weight_bytes))
    r_dec = timed(lambda: recipe_step(Ld, False), max(iters, 20))
    rows.append(row("torch-native", shape, routing, "decode-fwd", T_decode, r_dec,
                    6 * Ld.routes * D * F, GBps=weight_bytes / r_dec[0] / 1e6,
                    roofline_fraction=roofline_ms / r_dec[0]))
    if fp8 and fp8_recipe:
        try:
            recipe_fp8_ms = dict(recipe_fp8_ms or {})
            recipe_fp8_ms["decode-fwd"] = bench_recipe_fp8_decode(Ld, shape, routing, ceil, rows, iters)
        except (RuntimeError, TypeError, NotImplementedError, ValueError) as e:
            note = f"{shape} {routing}: torch-native-fp8 decode-fwd row left out: {e}"
            print(note, flush=True)
            NOTES.append(note)
            torch.cuda.empty_cache()
    Ld.forward(False)
    y_dec = Ld.y.clone()
    Ld.close()
    del Ld
    torch.cuda.empty_cache()
    if nvfp4:
        bench_nvfp4_decode(lib, shape, routing, ceil, rows, iters, t_dec, t_dec_graph, y_dec)
    if mxfp8:
        bench_mxfp8(lib, shape, routing, ceil, rows, iters, t_dec, t_dec_graph, y_dec, t_fwd,
                    y_bf16)
    if fp8:
        bench_fp8_forward(lib, shape, routing, ceil, rows, iters, y_bf16, t_fwd, recipe_fp8_ms)
        # The default (by_shape) row, then the other choice forced, against it.
        t8, wgrad = bench_fp8_train(lib, shape, routing, rows, iters, bf16_out, t_step,
                                    recipe_fp8_ms)
        bench_fp8_train(lib, shape, routing, rows, iters, bf16_out, t_step, recipe_fp8_ms,
                        force_wgrad="bf16" if wgrad == "fp8" else "fp8", t_step_fp8=t8)
    return err


def write_results(path, ceil, rows):
    sha = os.environ.get("EPMOE_SHA") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"sha": sha or "unknown",
           "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "num_gpus": torch.cuda.device_count(),
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                        "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cutlass": "4.2.0.0"},
           "ceilings": ceil, "rows": rows}
    if NOTES:
        out["notes"] = NOTES
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,mixtral-8x7b")
    ap.add_argument("--routings", default="balanced,skew")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--lib", default=None)
    ap.add_argument("--epmoe-only", default=None, metavar="IMPL",
                    help="time epmoe alone, rows named IMPL (e.g. epmoe-pingpong)")
    ap.add_argument("--epmoe-only-precision", default="bf16", choices=("bf16", "fp8-train"),
                    help="the --epmoe-only context's precision")
    ap.add_argument("--no-fp8", action="store_true",
                    help="leave out the epmoe-fp8 and torch-native-fp8 rows")
    ap.add_argument("--no-nvfp4", action="store_true", help="leave out the epmoe-nvfp4 rows")
    ap.add_argument("--nvfp4-only", action="store_true",
                    help="only the bf16 decode rows (epmoe, epmoe-graph) and the epmoe-nvfp4 rows")
    ap.add_argument("--no-mxfp8", action="store_true", help="leave out the epmoe-mxfp8 rows")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the bf16 decode rows (epmoe, epmoe-graph): A / B of the decode path")
    ap.add_argument("--mxfp8-only", action="store_true",
                    help="only the bf16 decode and fwd rows (epmoe, epmoe-graph) and the "
                         "epmoe-mxfp8 rows")
    ap.add_argument("--scratch-device-bytes", type=int, default=-1,
                    help="Config.scratch_device_bytes of the epmoe contexts (-1: all scratch on device)")
    args = ap.parse_args()
    global SCRATCH_DEVICE_BYTES
    SCRATCH_DEVICE_BYTES = args.scratch_device_bytes
    lib = epmoe_ctypes.load(args.lib)
    ceil = ceilings()
    print(f"ceilings: {ceil}", flush=True)
    rows = []
    fp8_recipe = False
    if (not args.no_fp8 and not args.epmoe_only and not args.nvfp4_only and not args.mxfp8_only
            and not args.decode_only):
        reason = torch_recipe_fp8.unsupported_reason()
        fp8_recipe = reason is None
        if reason:
            NOTES.append(f"torch-native-fp8 rows left out: {reason}")
            print(NOTES[-1], flush=True)
    for shape in args.shapes.split(","):
        for routing in args.routings.split(","):
            if args.epmoe_only:
                bench_epmoe_only(lib, shape, routing, rows, args.iters, args.epmoe_only,
                                 args.epmoe_only_precision)
                write_results(args.out, ceil, rows)
                continue
            if args.decode_only:
                bench_bf16_decode(lib, shape, routing, ceil, rows, args.iters)
                for r in rows[-2:]:
                    print(f"{shape:14s} {routing:9s} {r['impl']:18s} decode-fwd "
                          f"{r['median_ms']:9.4f} ms {100 * r['roofline_fraction']:.1f}% of HBM "
                          f"roofline", flush=True)
                write_results(args.out, ceil, rows)
                continue
            if args.mxfp8_only:
                dec = bench_bf16_decode(lib, shape, routing, ceil, rows, args.iters)
                bench_mxfp8(lib, shape, routing, ceil, rows, args.iters, *dec,
                            *bench_bf16_fwd(lib, shape, routing, ceil, rows, args.iters))
                write_results(args.out, ceil, rows)
                continue
            if args.nvfp4_only:
                bench_nvfp4_decode(lib, shape, routing, ceil, rows, args.iters,
                                   *bench_bf16_decode(lib, shape, routing, ceil, rows, args.iters))
                write_results(args.out, ceil, rows)
                continue
            err = bench_shape(lib, shape, routing, ceil, rows, args.iters, fp8=not args.no_fp8,
                              fp8_recipe=fp8_recipe, nvfp4=not args.no_nvfp4,
                              mxfp8=not args.no_mxfp8)
            for r in rows:
                if r["shape"] == shape and r["routing"] == routing and r.get("median_ms") is not None:
                    tf = r["useful_tflops"]
                    extra = ""
                    if r.get("ratio_to_recipe") is not None:
                        extra = f" x{r['ratio_to_recipe']:.2f} vs recipe"
                    if "roofline_fraction" in r:
                        extra = f" {100 * r['roofline_fraction']:.0f}% of HBM roofline"
                    if "ratio_to_grouped_mm" in r:
                        extra = f" x{r['ratio_to_grouped_mm']:.2f} vs _grouped_mm"
                    print(f"{shape:14s} {routing:9s} {r['impl']:18s} {r['phase']:18s} "
                          f"{r['median_ms']:9.3f} ms {tf if tf is None else round(tf, 1)} TFLOP/s{extra}",
                          flush=True)
            print(f"{shape} {routing} rel-L2 vs recipe: {err}", flush=True)
            write_results(args.out, ceil, rows)  # after every shape: a crash keeps what ran


if __name__ == "__main__":
    main()
