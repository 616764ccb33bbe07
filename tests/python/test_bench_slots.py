"""The activation-slot benchmark (bench/bench_slots.py) on the CPU backend through the C ABI
(libepmoe loaded by ctypes): a 4-layer stack at ci-tiny under every slot budget, the planner's
decisions it reports, and the bitwise equality of every budget with the full save. Skips where
libepmoe.so is not built (EPMOE_LIB names it; else build/src/ under the working directory, which
is the build directory under tools/test.sh, or under the repository)."""

import ctypes
import json
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))


def library():
    candidates = [os.environ.get("EPMOE_LIB"), os.path.join(os.getcwd(), "src", "libepmoe.so"),
                  os.path.join(ROOT, "build", "src", "libepmoe.so")]
    for path in candidates:
        if path and os.path.isfile(path):
            if not hasattr(ctypes.CDLL(path), "epmoe_context_create_cpu"):
                pytest.skip(f"{path} predates epmoe_context_create_cpu; rebuild libepmoe")
            return path
    pytest.skip("libepmoe.so is not built (set EPMOE_LIB, or build build/src/libepmoe.so)")


@pytest.mark.parametrize("shared", [False, True], ids=["own-weights", "shared-weights"])
def test_bench_slots_cpu_smoke(tmp_path, shared):
    import bench_slots

    out = tmp_path / "slots.json"
    args = ["--cpu", "--out", str(out), "--lib", library(), "--iters", "1", "--warmup", "0"]
    bench_slots.main(args + (["--shared-weights"] if shared else []))
    d = json.loads(out.read_text())
    assert d["benchmark"] == "slots" and d["gpu"] == "cpu"
    epmoe = {r["budget"]: r for r in d["rows"] if r["impl"] == "epmoe"}
    assert set(epmoe) == {"default", "full save", "half", "minimum"}
    assert [r["impl"] for r in d["rows"]].count("torch-native") == 1
    # Every route is live and EP = 1 receives all of them: the full save never recomputes; half
    # the span between the minimum and the full save leaves room for two of the four full saves.
    assert {b: r["recomputed_layers"] for b, r in epmoe.items()} == {
        "default": 0, "full save": 0, "half": 2, "minimum": 4}
    for r in epmoe.values():
        assert r["bitwise_equal_to_full_save"] is True, r["budget"]
        assert r["shared_weights"] is shared
        assert r["median_ms"] > 0 and r["context_device_bytes"] >= r["arena_bytes"] > 0
        assert r["peak_mem_bytes"] is None  # no device allocator count on the CPU
    assert epmoe["minimum"]["slot_bytes"] == epmoe["minimum"]["minimum_slot_bytes"]
    assert epmoe["full save"]["slot_bytes"] == epmoe["full save"]["balanced_full_save_slot_bytes"]
    assert epmoe["default"]["slot_bytes"] == epmoe["default"]["maximum_useful_slot_bytes"]
    assert epmoe["minimum"]["slot_peak_bytes"] < epmoe["half"]["slot_peak_bytes"] < \
        epmoe["full save"]["slot_peak_bytes"]
    verdicts = {t["target"]: t["met"] for t in d["targets"]}
    assert verdicts["full-save budget: no recompute"] is True
    assert verdicts["every budget bitwise equal to full save"] is True
