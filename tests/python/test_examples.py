"""The Python examples run as smoke tests: two CPU ranks under torchrun (and one GPU when there
is one)."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, requires_cuda, torchrun

EXAMPLES = os.path.join(ROOT, "examples", "python")

pytestmark = pytest.mark.multiprocess


def test_train_step_two_cpu_ranks():
    out = torchrun(os.path.join(EXAMPLES, "train_step.py"), "--device", "cpu").stdout
    losses = {}
    for rank, step, loss in re.findall(r"rank (\d)/2 step (\d): loss ([0-9.]+)", out):
        losses[(rank, step)] = float(loss)
    assert len(losses) == 4, out
    for rank in "01":
        assert losses[(rank, "1")] < losses[(rank, "0")], out  # one SGD step lowers the loss


def test_inference_two_cpu_ranks():
    out = torchrun(os.path.join(EXAMPLES, "inference.py"), "--device", "cpu").stdout
    assert "epmoe memory plan" in out and "inference" in out
    assert len(re.findall(r"rank \d/2: \d+ live tokens", out)) == 6, out


def test_memory_plan_without_any_process_group():
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "memory_plan.py"), "--shape", "deepseek-v3",
                           "--ep-size", "8"], capture_output=True, text=True, timeout=120, check=True)
    assert "deepseek-v3 at EP=8" in proc.stdout and "GiB per rank" in proc.stdout


@requires_cuda
def test_examples_on_one_gpu():
    for name in ("train_step.py", "inference.py"):
        out = torchrun(os.path.join(EXAMPLES, name), "--device", "cuda", nproc=1).stdout
        assert "rank 0/1" in out, out
