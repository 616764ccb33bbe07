"""Two bench_moe.py --epmoe-only (or --decode-only) runs side by side: per (shape, routing), the
fwd and fwd+bwd medians (decode-fwd per impl), each stage's median ms, run A / run B and B / A
(< 1: B faster).
    python3 bench/compare_stages.py A.json B.json"""
import json
import sys


def by_key(path):
    """(shape, routing) -> {"fwd": ms, "fwd+bwd": ms, "stages": {name: ms}} of the file's rows."""
    out = {}
    for r in json.load(open(path))["rows"]:
        entry = out.setdefault((r["shape"], r["routing"]), {"stages": {}})
        if r["phase"] == "stage-breakdown":
            entry["stages"] = r["stages_ms"]
        elif r["phase"] in ("fwd", "fwd+bwd") and r.get("median_ms") is not None:
            entry[r["phase"]] = r["median_ms"]
            if "fp8_wgrad" in r:
                entry["fp8_wgrad"] = r["fp8_wgrad"]
        elif r["phase"] == "decode-fwd" and r.get("median_ms") is not None:
            entry["decode " + r["impl"]] = r["median_ms"]
    return out


def line(name, a, b):
    if a is None or b is None:
        return f"  {name:24s} {a!s:>9s} {b!s:>9s}"
    return f"  {name:24s} {a:9.3f} {b:9.3f}  x{b / a:.3f}"


def main(path_a, path_b):
    runs_a, runs_b = by_key(path_a), by_key(path_b)
    print(f"A = {path_a}\nB = {path_b}\n  {'':24s} {'A ms':>9s} {'B ms':>9s}  B / A")
    for key in runs_a:
        if key not in runs_b:
            continue
        a, b = runs_a[key], runs_b[key]
        note = f" (fp8_wgrad {a['fp8_wgrad']})" if "fp8_wgrad" in a else ""
        print(f"{key[0]} {key[1]}{note}")
        phases = ["fwd", "fwd+bwd"] + [k for k in a if k.startswith("decode ")]
        for phase in phases:
            if phase in a or phase in b:
                print(line(phase, a.get(phase), b.get(phase)))
        for stage, ms in a["stages"].items():
            print(line(stage, ms, b["stages"].get(stage)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
