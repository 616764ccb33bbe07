"""Alternating A / B runs (device.sh ab or abpatch: run 0 = A, then B, A, B, ...) read as pairs:
per (shape, routing) and stage, each pair's B / A and their range (< 1: B faster), with both
sides' medians over the runs.
    python3 bench/ab_pairs.py ab0.json ab1.json ab2.json ab3.json ...
    python3 bench/ab_pairs.py --b 1,3,5 --a 0,2,4 <dir>/ab   (ab<i>.json in that folder)"""
import argparse
import os
import statistics

from compare_stages import by_key


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", help="the runs in order (A first), or one prefix with --a/--b")
    parser.add_argument("--a", help="comma-separated run indices of A (with a prefix)")
    parser.add_argument("--b", help="comma-separated run indices of B (with a prefix)")
    args = parser.parse_args()
    if args.a is not None:
        prefix = args.files[0]
        a_paths = [f"{prefix}{i}.json" for i in args.a.split(",")]
        b_paths = [f"{prefix}{i}.json" for i in args.b.split(",")]
    else:
        a_paths, b_paths = args.files[0::2], args.files[1::2]
    pairs = list(zip(a_paths, b_paths))
    runs = [(by_key(a), by_key(b)) for a, b in pairs]
    print("pairs (A, B): " + ", ".join(f"({os.path.basename(a)}, {os.path.basename(b)})" for a, b in pairs))
    print(f"  {'':24s} {'A ms':>9s} {'B ms':>9s}  B / A per pair")
    for key in runs[0][0]:
        print(f"{key[0]} {key[1]}")
        first = runs[0][0][key]
        names = ["fwd", "fwd+bwd"] + [k for k in first if k.startswith("decode ")]
        names += list(first["stages"])
        for name in names:
            a_ms, b_ms, ratios = [], [], []
            for ra, rb in runs:
                ea, eb = ra.get(key, {}), rb.get(key, {})
                va = ea.get(name, ea.get("stages", {}).get(name))
                vb = eb.get(name, eb.get("stages", {}).get(name))
                if va is None or vb is None:
                    continue
                a_ms.append(va)
                b_ms.append(vb)
                ratios.append(vb / va)
            if not ratios:
                continue
            each = " ".join(f"{r:.3f}" for r in ratios)
            print(f"  {name:24s} {statistics.median(a_ms):9.3f} {statistics.median(b_ms):9.3f}  "
                  f"x{min(ratios):.3f}-{max(ratios):.3f} ({each})")


if __name__ == "__main__":
    main()
