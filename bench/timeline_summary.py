"""Per-launch medians of the grouped GEMMs' tile timelines (a -DEPMOE_GEMM_TIMELINE=ON build;
src/cuda/gemm/tile_timeline.cuh): where one tile's SM clocks go.

    python3 bench/one_step.py --shape deepseek-v3 --precision bf16 --lib build-tl/src/libepmoe.so \
        > timeline.txt
    python3 bench/timeline_summary.py timeline.txt

Each launch prints one line per tile of CTA 0's window: `timeline BMxBNxNB g<grouping> seq s k K
rows R: <stamps>`, the stamps in Stamp's order, -1 where a stamp did not happen (a tile of the other
ping-pong warpgroup, a tile without a partial k-block). Columns (medians over the window's tiles,
SM clocks): period (to the next tile's start), wait (tile start to its first stage full), mma (first
stage full to every MMA retired), tail (the partial k-block's stage full to MMA retired, where there
is one), epilogue (MMA retired to epilogue issued), gap (epilogue issued to the next tile's start);
where the epilogue stamps its steps (WgradTmaEpilogue): drain (MMA retired to the previous tile's
TMA stores having read the stage) and stage (from then to the tile staged in shared memory).
"""
import argparse
import re
import statistics

LINE = re.compile(r"timeline (\d+x\d+x\d+) g(\d) seq (\d+) k (\d+) rows (-?\d+):((?: -?\d+)+)")
# Stamp order (tile_timeline.cuh); older files have seven (before tail_ready) or eight (before the
# epilogue's stage_free and staged).
STAMPS10 = ("start", "ready", "loop", "tail", "mma", "epilogue", "acq_first", "acq_last",
            "stage_free", "staged")
STAMPS = {len(s): s for s in (STAMPS10, STAMPS10[:8],
                              ("start", "ready", "loop", "mma", "epilogue", "acq_first", "acq_last"))}


def launches(path):
    """Consecutive lines of one (config, grouping) with rising seq form one launch."""
    current, last_seq = None, None
    with open(path) as f:
        for text in f:
            m = LINE.search(text)
            if not m:
                continue
            config, grouping, seq = m.group(1), int(m.group(2)), int(m.group(3))
            values = [int(v) for v in m.group(6).split()]
            names = STAMPS[len(values)]
            tile = dict(zip(names, values), k=int(m.group(4)), rows=int(m.group(5)))
            if current is None or (config, grouping) != current["key"] or seq <= last_seq:
                if current is not None:
                    yield current
                current = {"key": (config, grouping), "tiles": []}
            current["tiles"].append(tile)
            last_seq = seq
    if current is not None:
        yield current


def median(values):
    values = [v for v in values if v is not None and v >= 0]
    return int(statistics.median(values)) if values else None


def summary(launch):
    tiles = launch["tiles"]
    col = {name: [] for name in ("period", "wait", "mma", "tail", "epilogue", "gap", "drain",
                                 "stage")}
    for t, nxt in zip(tiles, tiles[1:] + [None]):
        if t["start"] < 0 or t.get("mma", -1) < 0:
            continue  # the other warpgroup's tile (ping-pong), or no MMA
        col["period"].append(nxt["start"] - t["start"] if nxt and nxt["start"] >= 0 else None)
        col["wait"].append(t["ready"] - t["start"] if t["ready"] >= 0 else None)
        col["mma"].append(t["mma"] - t["ready"] if t["ready"] >= 0 else None)
        col["tail"].append(t["mma"] - t["tail"] if t.get("tail", -1) >= 0 else None)
        col["epilogue"].append(t["epilogue"] - t["mma"])
        col["gap"].append(nxt["start"] - t["epilogue"] if nxt and nxt["start"] >= 0 else None)
        if t.get("stage_free", -1) >= 0 and t.get("staged", -1) >= 0:
            col["drain"].append(t["stage_free"] - t["mma"])
            col["stage"].append(t["staged"] - t["stage_free"])
    ks = sorted({t["k"] for t in tiles})
    return {name: median(v) for name, v in col.items()}, ks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    head = ("launch", "config", "g", "k-blocks", "period", "wait", "mma", "tail", "epilogue", "gap",
            "drain", "stage")
    for path in args.files:
        print(path)
        print("  ".join(f"{h:>9}" for h in head))
        for i, launch in enumerate(launches(path)):
            s, ks = summary(launch)
            config, grouping = launch["key"]
            cells = [str(i), config, str(grouping), ",".join(map(str, ks))]
            cells += ["-" if s[n] is None else str(s[n]) for n in head[4:]]
            print("  ".join(f"{c:>9}" for c in cells))


if __name__ == "__main__":
    main()
