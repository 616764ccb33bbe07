"""Benchmark of the routed experts at EP = 2 on two GPUs (MEASURE.md), one process per GPU:

    torchrun --nproc-per-node 2 bench/bench_ep.py --out results.json \\
        --lib build-gpu/src/libepmoe.so --nccl-lib build-gpu/src/cuda/comm/libepmoe_nccl.so

Every rank holds its own tokens x [T, D], ids over the global experts and its local experts'
weights. epmoe runs through the C ABI (contexts over the NCCL transport, the unique id sent over
torch.distributed); the torch-native EP recipe (bench/torch_recipe.py, all_to_all_single) runs in
the same processes on the same inputs. Per shape and routing: rel-L2 of epmoe vs the recipe,
forward and forward + backward step times (max over ranks of each iteration), useful TFLOP/s per
GPU, ratios to the dense-matmul ceiling and to the recipe, both epilogue variants, dispatch +
combine bandwidth against SM-driven peer stores measured in the same run, the imbalance figure
under skew, and every rank's stage breakdown. Rank 0 writes the JSON after every shape. The epmoe
fwd+bwd rows record "kernels" (explain_cuda_kernels at EP = 2: each grouped GEMM's kernel and the
rule that chose it) and "peer_access" (nccl-lsa or cuda-ipc, and why).

FP8 (opt-in through --variants): epmoe-fp8 is an fp8_block training context at EP = 2 with each
rank's local experts prepared once outside the timing (epmoe_prepare_weights_fp8 with the
transposed copies), timed as the bf16 variants on the same inputs, useful FLOPs as bf16, with
ratio_to_bf16 against the epmoe row and rel-L2 of y / grad_x / grad_scores against epmoe's bf16
outputs (the bf16 recipe's where epmoe did not run); torch-native-fp8 is the EP recipe with its
expert GEMMs on torch._scaled_grouped_mm (torch_recipe_fp8.moe_forward_ep: all_to_all dispatch and
combine unchanged, backward GEMMs in bf16), the epmoe-fp8 rows' ratio_to_recipe. Where
torch._scaled_grouped_mm does not run, its rows are left out with the reason in the JSON's notes.
epmoe-fp8-per-rank is epmoe-fp8 with Config.combine = per_rank (one combine row per token and
rank), timed and compared the same way. The epmoe-fp8 rows run the default Config.fp8_wgrad
(by_shape: the planner picks the weight gradients' precision from the shape at EP = 2) and record
its choice (fp8_wgrad: "fp8" or "bf16", epmoe_resolved_fp8_wgrad); epmoe-fp8-wgrad-bf16 and
epmoe-fp8-wgrad-fp8 force one choice (bf16: both weight gradients as bf16 WGRADs, x decoded from
its E4M3 rows; fp8: the FP8 WGRADs), with ratio_to_fp8 against the epmoe-fp8 rows;
epmoe-fp8-wgrad-other is, per shape, the one of the two that forces the choice by_shape did not
make, e.g.

    torchrun --nproc-per-node 2 bench/bench_ep.py --variants epmoe-fp8,epmoe-fp8-per-rank
    torchrun --nproc-per-node 2 bench/bench_ep.py --variants epmoe,epmoe-fp8,epmoe-fp8-wgrad-other

    torchrun --nproc-per-node 2 bench/bench_ep.py --self-check   (CPU, gloo: ep_self_check.py)
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402
import ep_self_check  # noqa: E402
import epmoe_ctypes  # noqa: E402
import measure  # noqa: E402
import shapes as S  # noqa: E402
import torch_recipe  # noqa: E402
import torch_recipe_fp8  # noqa: E402
from ep_accounting import (dispatch_combine_GBps, gather_objects, per_rank_bound_ms,  # noqa: E402
                           routes_to_ranks, step_stats, tokens_to_ranks, traffic)

OUTPUTS = ("y", "grad_x", "grad_scores", "grad_w13", "grad_w2")
# row name: (Config.fuse_epilogues, Config.arrival_gated_w13, Config.combine: 0 per_route,
# 1 per_rank). "epmoe" is the default (fused epilogues, dispatch then W13, one combine row per
# route); "epmoe-gated" overlaps W13 with dispatch through arrival counters; "epmoe-per-rank"
# sends one combine row per (token, rank) (forward and grad_x) and computes grad_scores on the
# expert side.
VARIANTS = {"epmoe": (True, False, 0), "epmoe-gated": (True, True, 0),
            "epmoe-unfused": (False, False, 0), "epmoe-per-rank": (True, False, 1)}
# fp8_block training contexts with prepared weights (Config.precision = fp8_block,
# prepared_weights): the same fields as above, then Config.fp8_wgrad forced ("fp8" or "bf16"; None:
# the default, by_shape). "epmoe-fp8-per-rank" is epmoe-fp8 with the per-rank combine;
# "epmoe-fp8-wgrad-bf16" / "-fp8" force the weight gradients' precision.
FP8_VARIANTS = {"epmoe-fp8": (True, False, 0, None), "epmoe-fp8-per-rank": (True, False, 1, None),
                "epmoe-fp8-wgrad-bf16": (True, False, 0, "bf16"),
                "epmoe-fp8-wgrad-fp8": (True, False, 0, "fp8")}
# In --variants: per shape, the epmoe-fp8-wgrad-* variant forcing the choice by_shape did not make.
WGRAD_OTHER = "epmoe-fp8-wgrad-other"
# The EP recipe with its expert GEMMs in row-wise fp8 (torch_recipe_fp8.moe_forward_ep).
RECIPE_FP8 = "torch-native-fp8"
# Outputs of an fp8 row compared with the bf16 ones (bench_moe.py's epmoe-fp8 rows: the same).
FP8_COMPARED = ("y", "grad_x", "grad_scores")
# Variants whose stage list times the combine's cross-rank stores as a stage of their own.
BANDWIDTH_VARIANTS = ("epmoe-unfused", "epmoe-per-rank")


# ---- distributed helpers ----

class Ranks:
    def __init__(self, cpu_group):
        self.rank, self.size, self.cpu = dist.get_rank(), dist.get_world_size(), cpu_group

    def gather(self, obj):
        """obj of every rank, in rank order, on every rank (over the gloo group)."""
        return gather_objects(obj, self.cpu)

    def barrier(self):
        dist.barrier(group=self.cpu)


def timed_ep(fn, ranks, iters, warmup=3):
    """(median, min, max) ms of the step over >= iters iterations: every rank times each iteration
    with CUDA events after a host barrier; the step time is the max over ranks."""
    times = measure.event_times(fn, iters, warmup, before=ranks.barrier)
    return step_stats(ranks.gather(times))


def pooled_rel_l2(ranks, parts):
    """parts: {name: (num, den)} of this rank -> {name: rel-L2 pooled over ranks}."""
    all_parts = ranks.gather(parts)
    return {k: (sum(p[k][0] for p in all_parts) / max(sum(p[k][1] for p in all_parts), 1e-300)) ** 0.5
            for k in parts}


# ---- one shape and routing ----

class Inputs:
    """This rank's tokens, routing and local experts' weights (per-rank seeds, never zeros)."""

    def __init__(self, shape, routing, rank, R, seed=0, device="cuda"):
        D, F, E, K, T, _ = S.SHAPES[shape]
        El = E // R
        g = torch.Generator(device=device).manual_seed(seed + 1000 * rank)
        self.D, self.F, self.E, self.El, self.K, self.T = D, F, E, El, K, T
        self.x = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
        self.w13 = (torch.randn(El, 2 * F, D, device=device, generator=g) / D ** 0.5).to(torch.bfloat16)
        self.w2 = (torch.randn(El, D, F, device=device, generator=g) / F ** 0.5).to(torch.bfloat16)
        self.ids, self.scores = S.route(routing, T, E, K, ep=R, generator=g, device=device)
        self.grad_y = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
        self.routes = S.useful_routes(self.ids)


def other_wgrad_variant(lib, inp, ep_size):
    """The epmoe-fp8-wgrad-* variant forcing the choice the default (by_shape) does not make on
    this shape at ep_size (the planner's resolution, epmoe_resolved_fp8_wgrad)."""
    cfg = lib.epmoe_config_default(inp.T, inp.D, inp.F, inp.K, inp.E)
    cfg.precision, cfg.prepared_weights = 1, 1
    chosen = epmoe_ctypes.resolved_fp8_wgrad(lib, cfg, ep_size)
    return "epmoe-fp8-wgrad-" + ("bf16" if chosen == "fp8" else "fp8")


class EpmoeRun:
    """An epmoe context over the NCCL transport and its output buffers."""

    def __init__(self, lib, nccl, ranks, inp, variant, capacity_factor, fp8=False):
        """fp8: an fp8_block training context whose forward and backward read this rank's
        experts prepared once here (with the transposed copies a backward reads)."""
        fused, gated, combine = variant[:3]
        cfg = lib.epmoe_config_default(inp.T, inp.D, inp.F, inp.K, inp.E)
        cfg.fuse_epilogues = int(fused)
        cfg.arrival_gated_w13 = int(gated)
        cfg.combine = combine
        cfg.capacity_factor = capacity_factor
        self.prepared = None
        if fp8:
            cfg.precision, cfg.inference, cfg.prepared_weights = 1, 0, 1
            if variant[3] is not None:
                cfg.fp8_wgrad = epmoe_ctypes.FP8_WGRADS.index(variant[3])
            self.fp8_wgrad = epmoe_ctypes.resolved_fp8_wgrad(lib, cfg, ranks.size)
            dev = torch.cuda.current_device()
            self.prepared = (epmoe_ctypes.PreparedFp8(lib, inp.w13, device=dev, transposed=True),
                             epmoe_ctypes.PreparedFp8(lib, inp.w2, device=dev, transposed=True))
        # The kernel each GEMM runs at this EP size, with this process's overrides (rows' "kernels").
        self.kernels = epmoe_ctypes.explain_kernels(lib, cfg, ranks.size)
        uid = epmoe_ctypes.nccl_unique_id(lib, nccl) if ranks.rank == 0 else None
        uid = ranks.gather(uid)[0]
        self.ctx = epmoe_ctypes.Context.create_nccl(lib, nccl, cfg, uid, ranks.rank, ranks.size,
                                                    torch.cuda.current_device())
        self.inp = inp
        self.y = torch.empty_like(inp.x)
        self.grad_x = torch.empty_like(inp.x)
        self.grad_scores = torch.empty(inp.T, inp.K, device="cuda")
        self.grad_w13 = torch.empty_like(inp.w13)
        self.grad_w2 = torch.empty_like(inp.w2)

    def forward(self, save=True):
        i = self.inp
        return self.ctx.forward(i.x, i.ids, i.scores, i.w13, i.w2, self.y, save=save,
                                prepared=self.prepared)

    def step(self):
        i = self.inp
        saved = self.forward(True)
        self.ctx.backward(saved, i.grad_y, i.ids, i.scores, i.w13, i.w2, self.grad_x,
                          self.grad_scores, self.grad_w13, self.grad_w2, prepared=self.prepared)

    def outputs(self):
        return {"y": self.y, "grad_x": self.grad_x, "grad_scores": self.grad_scores,
                "grad_w13": self.grad_w13, "grad_w2": self.grad_w2}

    def stage_times(self, steps=3):
        """[(stage, median ms over steps)] of forward then backward, in launch order."""
        self.ctx.stage_timing(True)
        runs = []
        for _ in range(steps):
            self.step()
            runs.append(self.ctx.stage_times())
        self.ctx.stage_timing(False)
        return [(name, statistics.median(r[i][1] for r in runs)) for i, (name, _) in enumerate(runs[0])]

    def close(self):
        self.ctx.close()
        self.prepared = None


def recipe_step(inp, backward, group=None, prepared=None):
    """The EP recipe's forward (and backward) on inp; prepared: the local experts'
    torch_recipe_fp8.quantize_weights for the fp8 recipe (made once, outside the timing)."""
    x = inp.x.detach().requires_grad_(backward)
    w13 = inp.w13.detach().requires_grad_(backward)
    w2 = inp.w2.detach().requires_grad_(backward)
    scores = inp.scores.detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        if prepared is None:
            y = torch_recipe.moe_forward_ep(x, inp.ids, scores, w13, w2, group)
        else:
            y = torch_recipe_fp8.moe_forward_ep(x, inp.ids, scores, w13, w2, prepared, group)
        if backward:
            y.backward(inp.grad_y)
    if not backward:
        return {"y": y}
    return {"y": y, "grad_x": x.grad, "grad_scores": scores.grad, "grad_w13": w13.grad,
            "grad_w2": w2.grad}


def row(impl, shape, routing, phase, T, ms, flops=None, GBps=None, **extra):
    med, lo, hi = ms if ms is not None else (None, None, None)
    r = {"impl": impl, "shape": shape, "ep": 2, "routing": routing, "precision": "bf16",
         "phase": phase, "tokens_per_rank": T, "median_ms": med, "min_ms": lo, "max_ms": hi,
         "useful_tflops": (flops / med / 1e9) if flops and med else None, "GBps": GBps,
         "busiest_rank_rows": None, "balanced_rows": None, "peak_mem_bytes": None}
    r.update(extra)
    return r


def bench_shape(lib, nccl, ranks, shape, routing, ceil, args):
    """Rows of one shape and routing (rank 0's list is the one written)."""
    inp = Inputs(shape, routing, ranks.rank, ranks.size)
    D, F, T = inp.D, inp.F, inp.T
    C = ranks.gather(routes_to_ranks(inp.ids, inp.El, ranks.size).tolist())
    tr = traffic(C, ranks.gather(tokens_to_ranks(inp.ids, inp.El, ranks.size).tolist()))
    flops_R = ranks.gather(inp.routes)  # live routes of each rank's tokens
    fwd_flops = 6 * statistics.mean(flops_R) * D * F  # per GPU: mean over ranks
    step_flops = 3 * fwd_flops
    common = {"busiest_rank_rows": tr["busiest_rank_rows"], "balanced_rows": tr["balanced_rows"]}
    rows = []

    # The recipe's outputs on these inputs: the reference of both variants.
    ref = {k: v.detach() for k, v in recipe_step(inp, True).items()}
    torch.cuda.synchronize()

    # Recipe timing first: its autograd memory is gone before the contexts exist.
    torch.cuda.reset_peak_memory_stats()
    r_fwd = timed_ep(lambda: recipe_step(inp, False), ranks, args.iters)
    r_step = timed_ep(lambda: recipe_step(inp, True), ranks, args.iters)
    recipe_peak = max(ranks.gather(torch.cuda.max_memory_allocated()))
    rows.append(row("torch-native", shape, routing, "fwd", T, r_fwd, fwd_flops, **common))
    rows.append(row("torch-native", shape, routing, "fwd+bwd", T, r_step, step_flops,
                    peak_mem_bytes=recipe_peak, **common))
    torch.cuda.empty_cache()

    # torch-native-fp8: outputs and times before the contexts exist (as the bf16 recipe's); its
    # rel-L2 once epmoe's bf16 outputs are there.
    r8 = None
    if RECIPE_FP8 in args.variants:
        prepared8 = (torch_recipe_fp8.quantize_weights(inp.w13),
                     torch_recipe_fp8.quantize_weights(inp.w2))
        y8_fwd = recipe_step(inp, False, prepared=prepared8)["y"].detach()
        out8 = {k: v.detach() for k, v in recipe_step(inp, True, prepared=prepared8).items()
                if k in FP8_COMPARED}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        r8_fwd = timed_ep(lambda: recipe_step(inp, False, prepared=prepared8), ranks, args.iters)
        r8_step = timed_ep(lambda: recipe_step(inp, True, prepared=prepared8), ranks, args.iters)
        r8 = {"fwd": r8_fwd, "fwd+bwd": r8_step,
              "peak": max(ranks.gather(torch.cuda.max_memory_allocated()))}
        del prepared8
        torch.cuda.empty_cache()

    errors, stages, times = {}, {}, {}
    bf16_out = None  # epmoe's y / grad_x / grad_scores: the fp8 rows' reference
    fp8_ceil = ceil.get("fp8_matmul_tflops")
    # bf16 variants first: the fp8 rows compare with the epmoe row; epmoe-fp8 first of the fp8
    # ones: the forced-wgrad rows compare with it.
    fp8_order = [other_wgrad_variant(lib, inp, ranks.size) if v == WGRAD_OTHER else v
                 for v in args.variants if v in FP8_VARIANTS or v == WGRAD_OTHER]
    fp8_order.sort(key=lambda v: v != "epmoe-fp8")
    order = [v for v in args.variants if v in VARIANTS] + list(dict.fromkeys(fp8_order))
    for impl in order:
        fp8 = impl in FP8_VARIANTS
        run = EpmoeRun(lib, nccl, ranks, inp, (FP8_VARIANTS if fp8 else VARIANTS)[impl],
                       args.capacity_factor, fp8=fp8)
        try:
            run.step()
            run.ctx.check()
            if fp8:
                base = bf16_out if bf16_out is not None else ref
                parts = {k: measure.rel_l2_parts(run.outputs()[k], base[k]) for k in FP8_COMPARED}
            else:
                parts = {k: measure.rel_l2_parts(v, ref[k]) for k, v in run.outputs().items()}
            errors[impl] = pooled_rel_l2(ranks, parts)
            if impl == "epmoe":
                bf16_out = {k: run.outputs()[k].clone() for k in FP8_COMPARED}
            t_fwd = timed_ep(lambda: run.forward(False), ranks, args.iters)
            t_step = timed_ep(run.step, ranks, args.iters)
            run.ctx.check()  # a skipped step (overflow) would time nothing
            stages[impl] = ranks.gather(run.stage_times())
            run.ctx.check()
            peer_access = run.ctx.peer_access()
            kernels = run.kernels
            fp8_wgrad = run.fp8_wgrad if fp8 else None
        finally:
            run.close()
            del run
            torch.cuda.empty_cache()
        times[impl] = {"fwd": t_fwd, "fwd+bwd": t_step}
        precision = "fp8" if fp8 else "bf16"
        ext = {"peer_access": peer_access, "capacity_factor": args.capacity_factor, **common}
        if fp8:
            bf16 = times.get("epmoe")
            ext.update(precision="fp8", prepared_weights=True,
                       fp8_wgrad=fp8_wgrad,  # the planner's choice (by_shape or forced)
                       rel_l2_reference="epmoe" if bf16_out is not None else "torch-native")
            fwd_extra = {
                "ratio_to_ceiling": fwd_flops / t_fwd[0] / 1e9 / fp8_ceil if fp8_ceil else None,
                "ratio_to_recipe": r8["fwd"][0] / t_fwd[0] if r8 else None,
                "ratio_to_bf16": bf16["fwd"][0] / t_fwd[0] if bf16 else None,
                "rel_l2_vs_bf16": {"y": errors[impl]["y"]}}
            step_extra = {
                "ratio_to_ceiling": step_flops / t_step[0] / 1e9 / fp8_ceil if fp8_ceil else None,
                "ratio_to_recipe": r8["fwd+bwd"][0] / t_step[0] if r8 else None,
                "ratio_to_bf16": bf16["fwd+bwd"][0] / t_step[0] if bf16 else None,
                "rel_l2_vs_bf16": errors[impl]}
            default8 = times.get("epmoe-fp8")
            if FP8_VARIANTS[impl][3] is not None and default8 is not None:
                fwd_extra["ratio_to_fp8"] = default8["fwd"][0] / t_fwd[0]
                step_extra["ratio_to_fp8"] = default8["fwd+bwd"][0] / t_step[0]
        else:
            ext["rel_l2_vs_recipe"] = errors[impl]
            bf16_ceil = ceil["bf16_matmul_tflops"]
            fwd_extra = {"ratio_to_ceiling": fwd_flops / t_fwd[0] / 1e9 / bf16_ceil,
                         "ratio_to_recipe": r_fwd[0] / t_fwd[0]}
            step_extra = {"ratio_to_ceiling": step_flops / t_step[0] / 1e9 / bf16_ceil,
                          "ratio_to_recipe": r_step[0] / t_step[0]}
        rows.append(row(impl, shape, routing, "fwd", T, t_fwd, fwd_flops, **fwd_extra, **ext))
        rows.append(row(impl, shape, routing, "fwd+bwd", T, t_step, step_flops, **step_extra,
                        kernels=kernels, **ext))
        for r, st in enumerate(stages[impl]):
            rows.append({"impl": impl, "shape": shape, "ep": 2, "routing": routing,
                         "precision": precision, "phase": "stage-breakdown", "tokens_per_rank": T,
                         "rank": r, "stages_ms": st, **tr})
    if r8 is not None:
        base = bf16_out if bf16_out is not None else ref
        err8_fwd = pooled_rel_l2(ranks, {"y": measure.rel_l2_parts(y8_fwd, base["y"])})
        err8 = pooled_rel_l2(ranks, {k: measure.rel_l2_parts(v, base[k]) for k, v in out8.items()})
        errors[RECIPE_FP8] = err8
        meta = {"precision": "fp8", "rel_l2_reference": "epmoe" if bf16_out is not None
                else "torch-native", **bench_moe.RECIPE_FP8_META, **common}
        rows.append(row(RECIPE_FP8, shape, routing, "fwd", T, r8["fwd"], fwd_flops,
                        rel_l2_vs_bf16=err8_fwd, ratio_to_ceiling=(
                            fwd_flops / r8["fwd"][0] / 1e9 / fp8_ceil if fp8_ceil else None),
                        **meta))
        rows.append(row(RECIPE_FP8, shape, routing, "fwd+bwd", T, r8["fwd+bwd"], step_flops,
                        rel_l2_vs_bf16=err8, peak_mem_bytes=r8["peak"], ratio_to_ceiling=(
                            step_flops / r8["fwd+bwd"][0] / 1e9 / fp8_ceil if fp8_ceil else None),
                        **meta))
        del y8_fwd, out8
    for impl in BANDWIDTH_VARIANTS:
        if impl not in stages:
            continue
        per_rank = VARIANTS[impl][2] == 1
        bw = dispatch_combine_GBps(stages[impl], tr["remote_rows"], tr["remote_token_rows"], D,
                                   per_rank=per_rank)
        peer = ceil.get("peer_store_GBps")
        hbm = ceil.get("hbm_copy_GBps")
        bound_R = (per_rank_bound_ms(tr, D, peer, hbm) if per_rank and peer and hbm and
                   "local_token_rows" in tr else None)
        for phase, (gbps, gbps_R, ms_R) in bw.items():
            ms = (max(ms_R),) * 3
            extra = {}
            if bound_R is not None and all(m > 0 for m in ms_R):
                extra = {"bound_ms_per_rank": bound_R,
                         "ratio_to_bound": sum(bound_R) / sum(ms_R)}
            rows.append(row(impl, shape, routing, phase, T, ms, GBps=gbps, **extra,
                            GBps_per_rank=gbps_R, ms_per_rank=ms_R,
                            remote_rows_per_rank=tr["remote_rows"],
                            remote_token_rows_per_rank=tr["remote_token_rows"],
                            combine_rows_per_rank=(tr["remote_token_rows"] if per_rank
                                                   else tr["remote_rows"]),
                            ratio_to_peer_store=gbps / peer if gbps and peer else None, **common))
    del ref, inp, bf16_out
    torch.cuda.empty_cache()
    return rows, errors, tr


def imbalance_rows(rows, shape):
    """Under skew: busiest GPU's received rows / balanced rows vs step time skew / balanced."""
    out = []

    def get(impl, routing, phase):
        for r in rows:
            if (r["impl"], r["shape"], r["routing"], r["phase"]) == (impl, shape, routing, phase):
                return r
        return None

    for impl in ("epmoe", "epmoe-gated", "epmoe-unfused", "epmoe-per-rank", "torch-native",
                 "epmoe-fp8", "epmoe-fp8-per-rank", RECIPE_FP8):
        bal, skew = get(impl, "balanced", "fwd+bwd"), get(impl, "skew", "fwd+bwd")
        if not bal or not skew:
            continue
        row_ratio = skew["busiest_rank_rows"] / skew["balanced_rows"]
        time_ratio = skew["median_ms"] / bal["median_ms"]
        out.append(row(impl, shape, "skew", "imbalance", skew["tokens_per_rank"], None,
                       busiest_rank_rows=skew["busiest_rank_rows"],
                       balanced_rows=skew["balanced_rows"], row_ratio=row_ratio,
                       time_ratio=time_ratio, balanced_fwd_bwd_ms=bal["median_ms"],
                       skew_fwd_bwd_ms=skew["median_ms"]))
    return out


# ---- ceilings ----

def peer_store(exe, mib=256):
    """SM-driven 16-byte peer stores, both GPUs at once (bench/ep_peer_store.cu): best GB/s per GPU
    over a CTA sweep, and the sweep. Runs before this process group touches the GPUs."""
    if not exe or not os.path.exists(exe):
        print(f"peer store: no executable at {exe}; peer_store_GBps stays null", flush=True)
        return None, None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "peer_store.json")
        proc = subprocess.run([exe, "--mib", str(mib), "--ctas", "16,32,66,132", "--json", path],
                              capture_output=True, text=True)
        print(proc.stdout + proc.stderr, end="", flush=True)
        if proc.returncode != 0 or not os.path.exists(path):
            return None, None
        sweep = json.load(open(path))
    best = max(min(r["gbps"]) for r in sweep["results"])  # per GPU: the slower of the two
    return best, sweep


def write_results(path, ceil, rows, ranks_info, notes=()):
    sha = os.environ.get("EPMOE_SHA") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"sha": sha or "unknown", "date": datetime.date.today().isoformat(),
           "gpu": torch.cuda.get_device_name(), "num_gpus": ranks_info["size"],
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                        "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cutlass": "4.2.0.0"},
           "ceilings": ceil, "rows": rows}
    if notes:
        out["notes"] = list(notes)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def summary(r):
    if r["phase"] == "stage-breakdown":
        return None
    tf = r.get("useful_tflops")
    s = f"{r['shape']:14s} {r['routing']:9s} {r['impl']:18s} {r['phase']:21s}"
    if r["phase"] == "imbalance":
        return s + f" rows x{r['row_ratio']:.2f} -> time x{r['time_ratio']:.2f}"
    s += f" {r['median_ms']:9.3f} ms"
    if tf is not None:
        s += f" {tf:6.1f} TFLOP/s/GPU"
    if r.get("ratio_to_ceiling") is not None:
        s += f" {r['ratio_to_ceiling']:.2f} of ceiling"
    if r.get("ratio_to_bf16") is not None:
        s += f" x{r['ratio_to_bf16']:.2f} vs epmoe bf16"
    if r.get("ratio_to_recipe") is not None:
        recipe = RECIPE_FP8 if r.get("precision") == "fp8" else "recipe"
        s += f" x{r['ratio_to_recipe']:.2f} vs {recipe}"
    if r.get("GBps") is not None:
        s += f" {r['GBps']:.0f} GB/s"
        if r.get("ratio_to_peer_store") is not None:
            s += f" ({100 * r['ratio_to_peer_store']:.0f}% of peer stores)"
        if r.get("ratio_to_bound") is not None:
            s += f", {100 * r['ratio_to_bound']:.0f}% of its NVLink/HBM bound"
    return s


def fp8_reference(rows, impl):
    """What an fp8 row's rel-L2 compares with: epmoe's bf16 outputs, or the bf16 recipe's."""
    ref = next((r.get("rel_l2_reference") for r in rows if r["impl"] == impl), None)
    return "epmoe bf16" if ref == "epmoe" else "torch-native bf16"


def main_gpu(args):
    local = int(os.environ.get("LOCAL_RANK", "0"))
    peer, sweep = (None, None)
    if local == 0 and not args.no_peer_store:
        exe = args.peer_store or os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(args.lib))), "bench", "ep_peer_store")
        peer, sweep = peer_store(exe)
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    ranks = Ranks(dist.new_group(backend="gloo"))
    if ranks.size != 2:
        raise SystemExit(f"bench_ep: expected 2 ranks (torchrun --nproc-per-node 2), got {ranks.size}")
    lib = epmoe_ctypes.load(args.lib)
    nccl = epmoe_ctypes.load_nccl(args.nccl_lib)
    c = measure.ceilings()
    all_c = ranks.gather(c)
    fp8_R = [x.get("fp8_matmul_tflops") for x in all_c]
    ceil = {"bf16_matmul_tflops": statistics.mean(x["bf16_matmul_tflops"] for x in all_c),
            "fp8_matmul_tflops": None if None in fp8_R else statistics.mean(fp8_R),
            "fp8_matmul_tflops_per_rank": fp8_R, "peer_store_GBps": ranks.gather(peer)[0],
            "hbm_copy_GBps": statistics.mean(x["hbm_copy_GBps"] for x in all_c),
            "bf16_matmul_tflops_per_rank": [x["bf16_matmul_tflops"] for x in all_c],
            "peer_store_sweep": ranks.gather(sweep)[0]}
    if ranks.rank == 0:
        print(f"ceilings: bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s, HBM copy "
              f"{ceil['hbm_copy_GBps']:.0f} GB/s, peer stores {ceil['peer_store_GBps']} GB/s per GPU",
              flush=True)
    notes = []
    if RECIPE_FP8 in args.variants:
        reasons = [r for r in ranks.gather(torch_recipe_fp8.unsupported_reason()) if r]
        if reasons:
            args.variants = [v for v in args.variants if v != RECIPE_FP8]
            notes.append(f"{RECIPE_FP8} rows left out: {reasons[0]}")
            if ranks.rank == 0:
                print(f"note: {notes[-1]}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for routing in args.routings.split(","):
            new, errors, tr = bench_shape(lib, nccl, ranks, shape, routing, ceil, args)
            if routing == "skew":
                new += imbalance_rows(rows + new, shape)
            rows += new
            if ranks.rank == 0:
                print(f"{shape} {routing}: received rows per rank {tr['received_rows']}, "
                      f"from the other rank {tr['remote_rows']}", flush=True)
                for r in new:
                    line = summary(r)
                    if line:
                        print(line, flush=True)
                for impl, e in errors.items():
                    fp8 = impl in FP8_VARIANTS or impl == RECIPE_FP8
                    base = fp8_reference(new, impl) if fp8 else "recipe"
                    print(f"{shape} {routing} {impl} rel-L2 vs {base}: " +
                          ", ".join(f"{k} {v:.2e}" for k, v in e.items()), flush=True)
                # a crash keeps what ran
                write_results(args.out, ceil, rows, {"size": ranks.size}, notes)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--lib", default=None, help="libepmoe.so (default: $EPMOE_LIB)")
    ap.add_argument("--nccl-lib", default=None, help="libepmoe_nccl.so (default: $EPMOE_NCCL_LIB)")
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,mixtral-8x7b")
    ap.add_argument("--routings", default="balanced,skew")
    ap.add_argument("--variants", default="epmoe,epmoe-unfused",
                    help=f"comma-separated from {sorted(VARIANTS)}, {sorted(FP8_VARIANTS)}, "
                         f"{WGRAD_OTHER} and {RECIPE_FP8} (the FP8 rows, opt-in)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--capacity-factor", type=float, default=2.0,
                    help="Config.capacity_factor (2 = R: skew fits)")
    ap.add_argument("--peer-store", default=None,
                    help="ep_peer_store executable (default: <build>/bench/ep_peer_store)")
    ap.add_argument("--no-peer-store", action="store_true")
    ap.add_argument("--self-check", action="store_true", help="CPU ranks (gloo): the recipe's math")
    args = ap.parse_args()
    if args.self_check:
        ep_self_check.self_check()
        return
    if not args.out:
        ap.error("--out is required")
    args.variants = [v for v in args.variants.split(",") if v]
    known = sorted(VARIANTS) + sorted(FP8_VARIANTS) + [WGRAD_OTHER, RECIPE_FP8]
    for v in args.variants:
        if v not in known:
            ap.error(f"--variants: expected names from {known}, got {v}")
    args.lib = args.lib or os.environ.get("EPMOE_LIB", "build/src/libepmoe.so")
    main_gpu(args)


if __name__ == "__main__":
    main()
