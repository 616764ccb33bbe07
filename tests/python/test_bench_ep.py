"""The EP = 2 benchmark's pure parts on CPU ranks (bench/bench_ep.py --self-check under torchrun,
gloo): the torch-native EP recipe (all_to_all_single) against the one-process recipe on the
concatenated batch for balanced, skew, empty-rank and one-expert routings, the traffic,
bandwidth and step-time accounting, and the FP8 EP recipe (torch-native-fp8: expert GEMMs on
torch._scaled_grouped_mm, emulated on CPU) against the one-process FP8 recipe."""

import os
import re

import pytest

from conftest import ROOT, torchrun

pytestmark = pytest.mark.multiprocess

ROUTINGS = ("balanced", "skew", "empty-rank", "one-expert")


@pytest.fixture(scope="module")
def self_check():
    return torchrun(os.path.join(ROOT, "bench", "bench_ep.py"), "--self-check").stdout


def test_ep_recipe_matches_one_process_recipe(self_check):
    assert "self-check: passed" in self_check, self_check[-4000:]


def test_ep_fp8_recipe_matches_one_process_fp8_recipe(self_check):
    skipped = re.search(r"self-check fp8: skipped \((.*)\)", self_check)
    if skipped:
        pytest.skip(f"the FP8 recipe cannot run on CPU here: {skipped.group(1)}")
    for rank in (0, 1):
        for routing in ROUTINGS:
            line = re.search(rf"self-check fp8 rank {rank} {routing}: (.*)", self_check)
            assert line, f"no fp8 line for rank {rank} {routing}:\n{self_check[-4000:]}"
            assert "FAILED" not in line.group(1), line.group(0)
