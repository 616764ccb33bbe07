"""bench/plot.py: the SVG plots of benchmark JSON (bars of useful TFLOP/s, decode as % of the HBM
roofline with the ratio to bf16), checked on a small hand-made document."""

import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))


def doc():
    rows = []
    for routing in ("balanced", "skew"):
        rows += [
            {"impl": "epmoe", "shape": "qwen3-30b-a3b", "routing": routing, "phase": "fwd+bwd",
             "useful_tflops": 480.0},
            {"impl": "torch-native", "shape": "qwen3-30b-a3b", "routing": routing, "phase": "fwd+bwd",
             "useful_tflops": 180.0},
            {"impl": "epmoe-graph", "shape": "qwen3-30b-a3b", "routing": routing,
             "phase": "decode-fwd", "roofline_fraction": 0.846},
            {"impl": "epmoe-nvfp4-graph", "shape": "qwen3-30b-a3b", "routing": routing,
             "phase": "decode-fwd", "roofline_fraction": 0.501, "ratio_to_bf16": 2.07},
            {"impl": "epmoe-nvfp4", "shape": "qwen3-30b-a3b", "routing": routing,
             "phase": "decode-fwd", "roofline_fraction": 0.434, "ratio_to_bf16": 1.93},
        ]
    return {"gpu": "NVIDIA H200", "sha": "a5828bf0", "ceilings": {"bf16_matmul_tflops": 776.0},
            "rows": rows}


def test_decode_plot_shows_roofline_percent_and_ratio(tmp_path):
    import plot

    out = tmp_path / "decode.svg"
    plot.decode(doc(), str(out), graph_only=True)
    svg = out.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert "a5828bf" in svg and "% of the HBM roofline" in svg
    assert svg.count(">85<") == 2 and svg.count(">50<") == 2  # one bar of each per routing
    assert svg.count(">x2.07<") == 2
    assert "epmoe-nvfp4-graph" in svg and ">epmoe-nvfp4<" not in svg  # eager rows left out
    plot.decode(doc(), str(out))
    assert ">x1.93<" in out.read_text()


def test_bars_plot_shows_each_implementation_and_the_ceiling(tmp_path):
    import plot

    out = tmp_path / "bars.svg"
    plot.bars(doc(), "fwd+bwd", str(out))
    svg = out.read_text()
    assert svg.count(">480<") == 2 and svg.count(">180<") == 2
    assert "dense bf16 matmul 776" in svg
