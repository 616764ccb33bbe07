"""Markdown tables of a bench/results JSON (MEASURE.md schema) for bench/RESULTS.md, EP = 1
(bench_moe.py) or EP = 2 (bench_ep.py), or the activation-slot stack (bench_slots.py):
    python3 bench/results_table.py bench/results/<file>.json"""
import json
import sys


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main(path):
    d = json.load(open(path))
    if d.get("benchmark") == "slots":
        slots_table(path, d)
        return
    if d["rows"] and d["rows"][0]["ep"] == 2:
        ep_tables(path, d)
        return
    c = d["ceilings"]
    print(f"### {d['date']} · {d['sha'][:7]} · {d['gpu']} · EP = {d['rows'][0]['ep']} · "
          f"torch {d['versions']['torch']} · CUDA {d['versions']['cuda']}\n")
    print(f"Ceilings in the same run: dense bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s, "
          f"HBM copy {c.get('hbm_copy_GBps', 0):.0f} GB/s. File: `{path}`.\n")
    print("| shape | routing | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | vs ceiling | "
          "vs torch-native (fwd / fwd+bwd) | W13 / W2 GEMM vs `_grouped_mm` | decode fwd (graph) ms | "
          "decode % HBM roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = d["rows"]
    keys = []
    for r in rows:
        k = (r["shape"], r["routing"])
        if k not in keys:
            keys.append(k)

    def get(shape, routing, impl, phase):
        for r in rows:
            if (r["shape"], r["routing"], r["impl"], r["phase"]) == (shape, routing, impl, phase):
                return r
        return {}

    for shape, routing in keys:
        f = get(shape, routing, "epmoe", "fwd")
        s = get(shape, routing, "epmoe", "fwd+bwd")
        g13 = get(shape, routing, "epmoe", "grouped-gemm-w13")
        g2 = get(shape, routing, "epmoe", "grouped-gemm-w2")
        dec = get(shape, routing, "epmoe-graph", "decode-fwd")
        print(f"| {shape} | {routing} | {fmt(f.get('median_ms'), '.3f')} | {fmt(f.get('useful_tflops'), '.0f')} | "
              f"{fmt(s.get('median_ms'), '.3f')} | {fmt(s.get('useful_tflops'), '.0f')} | "
              f"{fmt(s.get('ratio_to_ceiling'), '.2f')} | {fmt(f.get('ratio_to_recipe'), '.2f')}x / "
              f"{fmt(s.get('ratio_to_recipe'), '.2f')}x | {fmt(g13.get('ratio_to_grouped_mm'), '.2f')}x / "
              f"{fmt(g2.get('ratio_to_grouped_mm'), '.2f')}x | {fmt(dec.get('median_ms'), '.3f')} | "
              f"{fmt(100 * dec['roofline_fraction'] if dec else None, '.0f')} |")
    print("\nStage breakdown, fwd+bwd (ms; stages serialised by device syncs):\n")
    stage_rows = [r for r in rows if r["phase"] == "stage-breakdown"]
    if stage_rows:
        names = list(stage_rows[0]["stages_ms"].keys())
        print("| shape | routing | impl (precision) | " + " | ".join(names) + " |")
        print("|---|---|---|" + "---|" * len(names))
        for r in stage_rows:
            print(f"| {r['shape']} | {r['routing']} | {r['impl']} ({r.get('precision', 'bf16')}) | " +
                  " | ".join(f"{r['stages_ms'].get(n, 0):.3f}" for n in names) + " |")
    fp8 = [k for k in keys if get(*k, "epmoe-fp8", "fwd")]
    if fp8:
        fp8_ceil = c.get("fp8_matmul_tflops")
        print(f"\nFP8 forward (fp8_block inference, prepared weights) against the bf16 forward; "
              f"dense fp8 matmul ceiling {fmt(fp8_ceil, '.0f')} TFLOP/s:\n")
        print("| shape | routing | bf16 fwd ms | fp8 fwd ms | fp8 fwd TFLOP/s | speed-up | vs fp8 ceiling | "
              "y rel-L2 vs bf16 | fp8 decode fwd (graph) ms | decode % HBM roofline |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for shape, routing in fp8:
            b, f = get(shape, routing, "epmoe", "fwd"), get(shape, routing, "epmoe-fp8", "fwd")
            dec = get(shape, routing, "epmoe-fp8-graph", "decode-fwd")
            err = (f.get("rel_l2_vs_bf16") or {}).get("y")
            print(f"| {shape} | {routing} | {fmt(b.get('median_ms'), '.3f')} | {fmt(f.get('median_ms'), '.3f')} | "
                  f"{fmt(f.get('useful_tflops'), '.0f')} | {fmt(f.get('ratio_to_bf16'), '.2f')}x | "
                  f"{fmt(f.get('ratio_to_ceiling'), '.2f')} | {fmt(err, '.2e')} | "
                  f"{fmt(dec.get('median_ms'), '.3f')} | "
                  f"{fmt(100 * dec['roofline_fraction'] if dec else None, '.0f')} |")
    fp8_recipe_table(rows, keys, get)
    for note in d.get("notes", []):
        print(f"\nNote: {note}")


def errs(r):
    """'y 1.2e-02 · grad_x ...' of a row's rel_l2_vs_bf16, '-' where it has none."""
    e = r.get("rel_l2_vs_bf16") or {}
    return " · ".join(f"{k} {v:.1e}" for k, v in e.items()) or "-"


def fp8_recipe_table(rows, keys, get):
    """epmoe-fp8 against the torch-native FP8 recipe (torch._scaled_grouped_mm, row-wise scales)
    measured in the same run: times, the ratio epmoe-fp8 / torch-native-fp8 (recipe ms / epmoe ms),
    and each one's rel-L2 against epmoe's bf16 outputs on the same inputs."""
    phases = ("fwd", "fwd+bwd", "decode-fwd")
    keys = [k for k in keys if any(get(*k, "torch-native-fp8", p) for p in phases)]
    if not keys:
        return
    meta = next(r for r in rows if r["impl"] == "torch-native-fp8")
    print("\nFP8 against the torch-native FP8 recipe (same run, same inputs): "
          f"{meta.get('fp8_scaling', '-')}; forward GEMMs {meta.get('fwd_gemms', '-')}, backward "
          f"GEMMs {meta.get('bwd_gemms', '-')}. Ratio = torch-native-fp8 ms / epmoe-fp8 ms; rel-L2 "
          "against epmoe's bf16 outputs:\n")
    print("| shape | routing | phase | epmoe-fp8 ms | torch-native-fp8 ms | epmoe-fp8 / torch-native-fp8 | "
          "epmoe-fp8 TFLOP/s | torch-native-fp8 TFLOP/s | epmoe-fp8 rel-L2 | torch-native-fp8 rel-L2 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, routing in keys:
        for phase in phases:
            e, t = get(shape, routing, "epmoe-fp8", phase), get(shape, routing, "torch-native-fp8", phase)
            if not e and not t:
                continue
            print(f"| {shape} | {routing} | {phase} | {fmt(e.get('median_ms'), '.3f')} | "
                  f"{fmt(t.get('median_ms'), '.3f')} | {fmt(e.get('ratio_to_recipe'), '.2f')}x | "
                  f"{fmt(e.get('useful_tflops'), '.0f')} | {fmt(t.get('useful_tflops'), '.0f')} | "
                  f"{errs(e)} | {errs(t)} |")


def pct(ratio):
    return None if ratio is None else 100 * ratio


def stage_columns(stages):
    """[(name, ms)] in launch order -> (unique column names, values): repeats get .2, .3, ..."""
    seen, names = {}, []
    for name, _ in stages:
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}.{seen[name]}")
    return names, [ms for _, ms in stages]


def slots_table(path, d):
    """bench_slots.py: a 4-layer stack per shape at each slot budget against the recipe."""
    rows = d["rows"]
    print(f"### {d['date']} · {d['sha'][:7]} · {d['gpu']} · EP = 1 · activation slots, "
          f"{rows[0]['layers'] if rows else 4}-layer stack fwd+bwd · torch {d['versions']['torch']}\n")
    print("Peak = torch allocations of the step above the allocation before its forward + the "
          "context's device bytes; the recipe's peak also less one w13-gradient temporary "
          f"(the target's measure). File: `{path}`.\n")
    print("| shape | T | impl | budget | slot MiB | recomputed layers | fwd+bwd ms | vs full save | "
          "peak MiB | vs recipe peak | vs recipe less wgrad | bitwise = full save |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for r in rows:
        slot = r.get("slot_bytes")
        peak = r.get("peak_mem_bytes")
        extra = ""
        if r["impl"] != "epmoe" and r.get("activation_peak_bytes") is not None:
            extra = f" ({fmt(r['activation_peak_bytes'] / mib, '.0f')} less wgrad)"
        print(f"| {r['shape']} | {r['tokens_per_rank']} | {r['impl']} | {r.get('budget') or '-'} | "
              f"{fmt(None if slot is None else slot / mib, '.1f')} | {r.get('recomputed_layers', '-')} | "
              f"{fmt(r['median_ms'], '.3f')} | {fmt(r.get('time_ratio_to_full_save'), '.3f')} | "
              f"{fmt(None if peak is None else peak / mib, '.0f')}{extra} | "
              f"{fmt(r.get('ratio_to_recipe_peak'), '.3f')} | "
              f"{fmt(r.get('ratio_to_recipe_activation_peak'), '.3f')} | "
              f"{r.get('bitwise_equal_to_full_save', '-')} |")
    if d.get("targets"):
        print("\n| shape | target | value | verdict |\n|---|---|---|---|")
        for t in d["targets"]:
            v = t["value"]
            verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "missed")
            print(f"| {t['shape']} | {t['target']} | {fmt(v, '.3f') if isinstance(v, float) else v} | "
                  f"{verdict} |")


def ep_tables(path, d):
    c, rows = d["ceilings"], d["rows"]
    peer = c.get("peer_store_GBps")
    print(f"### {d['date']} · {d['sha'][:7]} · {d['num_gpus']} × {d['gpu']} · EP = 2 · "
          f"torch {d['versions']['torch']} · CUDA {d['versions']['cuda']} · "
          f"NCCL {d['versions']['nccl']}\n")
    print(f"Ceilings in the same run: dense bf16 matmul {fmt(c.get('bf16_matmul_tflops'), '.0f')} "
          f"TFLOP/s (mean of the GPUs), SM-driven peer stores {fmt(peer, '.0f')} GB/s per GPU (both "
          f"directions at once). Step time = max over ranks of each iteration; TFLOP/s per GPU = "
          f"mean over ranks of 18·N·D·F (fwd+bwd) / step time. File: `{path}`.\n")

    def get(shape, routing, impl, phase):
        for r in rows:
            if (r["shape"], r["routing"], r["impl"], r["phase"]) == (shape, routing, impl, phase):
                return r
        return {}

    keys = []
    for r in rows:
        if (r["shape"], r["routing"]) not in keys and r["phase"] in ("fwd", "fwd+bwd"):
            keys.append((r["shape"], r["routing"]))
    impls = [i for i in ("epmoe", "epmoe-gated", "epmoe-staged", "epmoe-unfused", "epmoe-per-rank", "torch-native") if any(r["impl"] == i for r in rows)]
    print("| shape | routing | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms (min–max) | fwd+bwd TFLOP/s | "
          "vs ceiling | vs torch-native (fwd / fwd+bwd) | max rel-L2 vs recipe |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, routing in keys:
        for impl in impls:
            f, s = get(shape, routing, impl, "fwd"), get(shape, routing, impl, "fwd+bwd")
            if not s:
                continue
            err = s.get("rel_l2_vs_recipe")
            vs = "-" if impl == "torch-native" else (f"{fmt(f.get('ratio_to_recipe'), '.2f')}x / "
                                                     f"{fmt(s.get('ratio_to_recipe'), '.2f')}x")
            # The weight gradients' precision the context ran (by_shape resolved, or forced).
            name = f"{impl} (wgrad {s['fp8_wgrad']})" if s.get("fp8_wgrad") else impl
            print(f"| {shape} | {routing} | {name} | {fmt(f.get('median_ms'), '.3f')} | "
                  f"{fmt(f.get('useful_tflops'), '.0f')} | {fmt(s.get('median_ms'), '.3f')} "
                  f"({fmt(s.get('min_ms'), '.3f')}–{fmt(s.get('max_ms'), '.3f')}) | "
                  f"{fmt(s.get('useful_tflops'), '.0f')} | {fmt(s.get('ratio_to_ceiling'), '.2f')} | "
                  f"{vs} | {fmt(max(err.values()) if err else None, '.1e')} |")
    fp8_impls = ep_fp8_table(c, rows, keys, get)

    bw = [r for r in rows if r["phase"] in ("dispatch+combine", "dispatch+combine-bwd")]
    if bw:
        print("\nDispatch + combine alone (unfused chain, stage timing: forward dispatch + scatter_rows, "
              "backward gather_grad + scatter_rows; bytes = 2 × rows from the other rank × D × 2; "
              "GB/s = bytes / time summed over ranks):\n")
        print("| shape | routing | phase | rows from the other rank (rank 0, 1) | of which distinct "
              "tokens | ms (rank 0, 1) | GB/s (rank 0, 1) | GB/s | vs peer stores |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in bw:
            print(f"| {r['shape']} | {r['routing']} | {r['phase']} | "
                  f"{', '.join(str(x) for x in r['remote_rows_per_rank'])} | "
                  f"{', '.join(str(x) for x in r.get('remote_token_rows_per_rank', []))} | "
                  f"{', '.join(fmt(x, '.3f') for x in r['ms_per_rank'])} | "
                  f"{', '.join(fmt(x, '.0f') for x in r['GBps_per_rank'])} | {fmt(r['GBps'], '.0f')} | "
                  f"{fmt(pct(r.get('ratio_to_peer_store')), '.0f')}% |")

    imb = [r for r in rows if r["phase"] == "imbalance"]
    if imb:
        print("\nImbalance (skew vs balanced, fwd+bwd): the busiest GPU's received rows against the "
              "balanced share, and the step time ratio:\n")
        print("| shape | impl | busiest rows / balanced | time skew / balanced | balanced ms | skew ms |")
        print("|---|---|---|---|---|---|")
        for r in imb:
            print(f"| {r['shape']} | {r['impl']} | {r['busiest_rank_rows']} / {r['balanced_rows']} = "
                  f"{r['row_ratio']:.2f} | {r['time_ratio']:.2f} | {r['balanced_fwd_bwd_ms']:.3f} | "
                  f"{r['skew_fwd_bwd_ms']:.3f} |")

    stage_rows = [r for r in rows if r["phase"] == "stage-breakdown"]
    for impl in impls + fp8_impls:
        mine = [r for r in stage_rows if r["impl"] == impl]
        if not mine:
            continue
        names, _ = stage_columns(mine[0]["stages_ms"])
        print(f"\nStage breakdown of {impl}, fwd+bwd, per rank (ms; stages serialised by device "
              "syncs, barriers include waiting for the other rank):\n")
        print("| shape | routing | rank | " + " | ".join(names) + " |")
        print("|---|---|---|" + "---|" * len(names))
        for r in mine:
            n, v = stage_columns(r["stages_ms"])
            by = dict(zip(n, v))
            print(f"| {r['shape']} | {r['routing']} | {r['rank']} | " +
                  " | ".join(fmt(by.get(x), '.3f') for x in names) + " |")
    for note in d.get("notes", []):
        print(f"\nNote: {note}")


def ep_fp8_table(c, rows, keys, get):
    """The EP = 2 FP8 rows (bench_ep.py --variants epmoe-fp8,torch-native-fp8): times, ratios to
    epmoe's bf16 row and to the torch-native FP8 recipe, rel-L2 against bf16 outputs. Returns the
    FP8 impls present."""
    impls = [i for i in ("epmoe-fp8", "epmoe-fp8-per-rank", "epmoe-fp8-wgrad-bf16",
                         "epmoe-fp8-wgrad-fp8", "torch-native-fp8")
             if any(r["impl"] == i for r in rows)]
    if not impls:
        return impls
    print(f"\nFP8 at EP = 2: epmoe-fp8 is an fp8_block training context with prepared weights; "
          f"useful FLOPs as bf16; dense fp8 matmul ceiling {fmt(c.get('fp8_matmul_tflops'), '.0f')} "
          "TFLOP/s. Ratios = other ms / this row's ms; rel-L2 (fwd+bwd) against epmoe's bf16 "
          "outputs on the same inputs (the bf16 recipe's where the row says so).")
    meta = next((r for r in rows if r["impl"] == "torch-native-fp8"), None)
    if meta:
        print(f"torch-native-fp8: the EP recipe's all_to_all dispatch and combine, "
              f"{meta.get('fp8_scaling', '-')}; forward GEMMs {meta.get('fwd_gemms', '-')}, "
              f"backward GEMMs {meta.get('bwd_gemms', '-')}.")
    print("\n| shape | routing | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms (min–max) | "
          "fwd+bwd TFLOP/s | vs fp8 ceiling | vs epmoe bf16 (fwd / fwd+bwd) | "
          "vs torch-native-fp8 (fwd / fwd+bwd) | rel-L2 vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, routing in keys:
        for impl in impls:
            f, s = get(shape, routing, impl, "fwd"), get(shape, routing, impl, "fwd+bwd")
            if not s:
                continue
            vs_bf16 = vs_recipe = "-"
            if impl != "torch-native-fp8":
                vs_bf16 = (f"{fmt(f.get('ratio_to_bf16'), '.2f')}x / "
                           f"{fmt(s.get('ratio_to_bf16'), '.2f')}x")
                if s.get("ratio_to_recipe") is not None:  # torch-native-fp8 ran
                    vs_recipe = (f"{fmt(f.get('ratio_to_recipe'), '.2f')}x / "
                                 f"{fmt(s.get('ratio_to_recipe'), '.2f')}x")
            ref = "" if s.get("rel_l2_reference", "epmoe") == "epmoe" else " (vs torch-native)"
            # The weight gradients' precision the context ran (by_shape resolved, or forced).
            name = f"{impl} (wgrad {s['fp8_wgrad']})" if s.get("fp8_wgrad") else impl
            print(f"| {shape} | {routing} | {name} | {fmt(f.get('median_ms'), '.3f')} | "
                  f"{fmt(f.get('useful_tflops'), '.0f')} | {fmt(s.get('median_ms'), '.3f')} "
                  f"({fmt(s.get('min_ms'), '.3f')}–{fmt(s.get('max_ms'), '.3f')}) | "
                  f"{fmt(s.get('useful_tflops'), '.0f')} | {fmt(s.get('ratio_to_ceiling'), '.2f')} | "
                  f"{vs_bf16} | {vs_recipe} | {errs(s)}{ref} |")
    return impls


if __name__ == "__main__":
    main(sys.argv[1])
