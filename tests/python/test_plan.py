"""plan_memory: pure, explains every term, and is what create_context allocates."""

import epmoe
from conftest import tiny_config


def test_explain_lists_every_region():
    plan = epmoe.plan_memory(tiny_config(), 2)
    text = plan.explain()
    for word in ("receive rows", "symmetric", "scratch", "slot", "total"):
        assert word in text, word
    assert plan.recv_capacity_rows == plan.fields["recv_capacity_rows"] > 0
    assert plan.ep_size == 2 and plan.experts_local == 2
    assert plan.total_bytes >= plan.arena_bytes + plan.symmetric_bytes


def test_capacity_factor_is_clamped_to_the_topology_bound():
    small = epmoe.plan_memory(tiny_config(device_scratch_capacity_factor=1.0), 2)
    big = epmoe.plan_memory(tiny_config(device_scratch_capacity_factor=100.0), 2)
    assert small.recv_capacity_rows == small.balanced_recv_rows
    assert big.recv_capacity_rows == big.max_recv_rows


def test_context_carries_its_plan(context):
    assert context.memory_plan.total_bytes == epmoe.plan_memory(context.config, 1).total_bytes
    assert context.capacity_rows == context.memory_plan.recv_capacity_rows


def test_import_initialises_neither_cuda_nor_a_process_group():
    import subprocess
    import sys

    code = ("import torch, epmoe, epmoe.integrations; import torch.distributed as dist; "
            "assert not torch.cuda.is_initialized(); assert not dist.is_initialized(); "
            "print(sorted(epmoe.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "routed_experts" in out.stdout
