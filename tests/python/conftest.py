"""Shared fixtures: the tiny config every CPU test uses, and a torchrun launcher for the tests
that run CPU ranks as processes (gloo bootstrap, shared-memory transport)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import epmoe  # noqa: E402

# D, F multiples of 8 so the same shapes run on CUDA.
T, D, F, K, EXPERTS = 24, 64, 32, 2, 4


def tiny_config(**overrides) -> epmoe.Config:
    fields = dict(max_num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                  num_experts=EXPERTS, device_scratch_capacity_factor=4.0)
    fields.update(overrides)
    return epmoe.Config(**fields)


@pytest.fixture
def context():
    ctx = epmoe.create_context(None, tiny_config(), "cpu")
    yield ctx
    ctx.close()


def has_cuda() -> bool:
    return torch.cuda.is_available() and torch.ops.epmoe._cuda_device_count() > 0


requires_cuda = pytest.mark.skipif(
    not has_cuda(), reason="needs a CUDA GPU and epmoe built with CUDA (none here)")


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """Runs `script` under torchrun with nproc CPU ranks; fails the test with the output on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                    f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc
