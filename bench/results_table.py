"""Markdown tables of a bench/results JSON (MEASURE.md schema) for bench/RESULTS.md:
    python3 bench/results_table.py bench/results/<file>.json"""
import json
import sys


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main(path):
    d = json.load(open(path))
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
        print("| shape | routing | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for r in stage_rows:
            print(f"| {r['shape']} | {r['routing']} | " +
                  " | ".join(f"{r['stages_ms'].get(n, 0):.3f}" for n in names) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
