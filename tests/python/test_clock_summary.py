"""bench/clock_summary.py: the clock log device.sh writes, summarised per GPU (a cut-off last
sample left out, samples under 200 W not counted as under load)."""

import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_clock_summary_per_gpu():
    import clock_summary

    lines = ["2026/11/30 15:00:00.000, 0, 1980 MHz, 650.12 W, 61",
             "2026/11/30 15:00:00.500, 0, 1755 MHz, 699.80 W, 66",
             "2026/11/30 15:00:00.500, 1, 345 MHz, 80.10 W, 30",
             "2026/11/30 15:00:00.600, 0, 1980 MHz, 90.00 W, 60",
             "2026/11/30 15:00:01.000, 0, 19"]
    gpus = clock_summary.parse(lines)
    assert sorted(gpus) == [0, 1]
    assert gpus[0][1] == (1755.0, 699.8, 66.0)
    assert len(gpus[0]) == 3
    out = clock_summary.summary(gpus)
    assert out[0].startswith("GPU 0: 3 samples, 2 under load; SM MHz under load median 1868, "
                             "min 1755, max 1980, 50 % below 95 % of max; power max 700 W")
    assert out[1].startswith("GPU 1: 1 samples, 0 under load; SM MHz under load median 345")
