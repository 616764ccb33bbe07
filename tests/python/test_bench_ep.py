"""The EP = 2 benchmark's pure parts on CPU ranks (bench/bench_ep.py --self-check under torchrun,
gloo): the torch-native EP recipe (all_to_all_single) against the one-process recipe on the
concatenated batch for balanced, skew, empty-rank and one-expert routings, and the traffic,
bandwidth and step-time accounting."""

import os

import pytest

from conftest import ROOT, torchrun

pytestmark = pytest.mark.multiprocess


def test_ep_recipe_matches_one_process_recipe():
    proc = torchrun(os.path.join(ROOT, "bench", "bench_ep.py"), "--self-check")
    assert "self-check: passed" in proc.stdout, proc.stdout[-4000:]
