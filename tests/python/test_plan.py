"""plan_memory: pure, explains every term, and is what create_context allocates."""

import os
import re

import pytest

import epmoe
from conftest import ROOT, tiny_config

# Training (default slots, slot_bytes, slot factor, several layers per slot), inference, EP = 1..4.
PLAN_CASES = [
    (dict(), 1),
    (dict(), 2),
    (dict(activation_slot_capacity_factor=1.5, num_activation_slots=2), 2),
    (dict(activation_slot_bytes=20000, max_moe_layers_per_activation_slot=3, num_activation_slots=3), 4),
    (dict(device_scratch_capacity_factor=1.1, hidden_dim=72, intermediate_dim=40), 2),
    (dict(inference=True, num_activation_slots=0), 2),
]


def header_fields():
    """Member names of struct MemoryPlan in include/epmoe/memory_plan.h, in order."""
    text = open(os.path.join(ROOT, "include", "epmoe", "memory_plan.h")).read()
    body = text[text.index("struct MemoryPlan {"):]
    body = body[:body.index("\n};")]
    return re.findall(r"^\s+[\w:]+\s+(\w+)\s*=", body, re.M)


def explained(text):
    """The plan's numbers as explain() prints them (C++ MemoryPlan::explain), by field name."""
    out = {}

    def grab(label, *names):
        line = next(l for l in text.splitlines() if l.strip().startswith(label))
        values = [int(v.replace(",", "")) for v in re.findall(r"\(([\d,]+) bytes\)", line)]
        assert len(values) == len(names), (line, names)
        out.update(zip(names, values))

    rows = re.search(r"balanced ([\d,]+) \(T\*K\) / capacity ([\d,]+) / topology max ([\d,]+)", text)
    for name, v in zip(("balanced_recv_rows", "recv_capacity_rows", "max_recv_rows"), rows.groups()):
        out[name] = int(v.replace(",", ""))
    out["packing_granule_bytes"] = int(re.search(r"lcm\(128, 2D\): ([\d,]+) bytes", text)[1].replace(",", ""))
    grab("symmetric buffers per rank:", "symmetric_bytes")
    grab("routing (header", "routing_buffer_bytes")
    grab("dispatch x / grad_y", "dispatch_buffer_bytes")
    grab("combine [T,K,D]", "combine_buffer_bytes")
    grab("metadata (planner record", "layer_metadata_bytes", "routing_metadata_bytes")
    grab("input only (recompute)", "saved_input_bytes_per_layer")
    grab("full save (x_gathered", "saved_full_bytes_balanced")
    grab("full save at capacity rows", "saved_full_bytes_capacity")
    grab("scratch:", "scratch_bytes", "route_scratch_bytes", "call_scratch_pad_bytes",
         "backward_scratch_bytes")
    grab("forward (recompute mode)", "forward_scratch_bytes", "backward_scratch_bytes")
    grab("status word", "status_bytes")
    grab("peer tables", "peer_table_bytes")
    grab("arena", "arena_bytes")
    grab("total", "total_bytes")
    if "(inference)" not in text:
        grab("activation slots:", "slot_bytes", "activation_bytes")
        slots = re.search(r"activation slots: (\d+) x .*; (\d+) layer\(s\) per slot", text)
        out["num_slots"], out["layers_per_slot"] = int(slots[1]), int(slots[2])
        grab("slot metadata (L layers)", "slot_metadata_bytes", "planner_state_bytes")
        grab("activation slot minimum", "minimum_slot_bytes", "balanced_full_save_slot_bytes",
             "maximum_useful_slot_bytes")
    return out


def test_explain_lists_every_region():
    plan = epmoe.plan_memory(tiny_config(), 2)
    text = plan.explain()
    for word in ("receive rows", "symmetric", "scratch", "slot", "total"):
        assert word in text, word
    assert plan.recv_capacity_rows == plan.fields["recv_capacity_rows"] > 0
    assert plan.ep_size == 2 and plan.experts_local == 2
    assert plan.total_bytes >= plan.arena_bytes + plan.symmetric_bytes


def test_python_has_every_field_of_the_cpp_plan():
    names = header_fields()
    assert len(names) > 30 and "planner_state_bytes" in names
    plan = epmoe.plan_memory(tiny_config(), 2)
    assert list(plan.fields) == names
    for name in names:
        assert getattr(plan, name) == plan.fields[name]


@pytest.mark.parametrize("overrides,ep_size", PLAN_CASES)
def test_python_fields_equal_the_cpp_plan(overrides, ep_size):
    plan = epmoe.plan_memory(tiny_config(**overrides), ep_size)
    cpp = explained(plan.explain())
    assert len(cpp) >= (20 if plan.inference else 28)
    for name, value in cpp.items():
        assert plan.fields[name] == value, name
    assert plan.ep_size == ep_size
    assert plan.inference == overrides.get("inference", False)
    sizing = plan.slot_sizing
    if plan.inference:
        assert sizing == "none" and plan.num_slots == 0 and plan.activation_bytes == 0
    elif "activation_slot_bytes" in overrides:
        assert sizing == "exact" and plan.slot_bytes % plan.packing_granule_bytes == 0
        assert plan.slot_bytes >= overrides["activation_slot_bytes"]
    elif "activation_slot_capacity_factor" in overrides:
        assert sizing == "factor"
        assert plan.slot_capacity_factor == overrides["activation_slot_capacity_factor"]
    else:
        assert sizing == "maximum_useful" and plan.slot_bytes == plan.maximum_useful_slot_bytes
    requested = tiny_config(**overrides).device_scratch_capacity_factor
    assert plan.requested_capacity_factor == requested  # the exact double
    assert plan.capacity_factor == min(requested, ep_size)


@pytest.mark.parametrize("overrides,ep_size", PLAN_CASES)
def test_plan_sums(overrides, ep_size):
    p = epmoe.plan_memory(tiny_config(**overrides), ep_size)
    assert p.total_bytes == (p.arena_bytes + p.symmetric_bytes + p.status_bytes + p.peer_table_bytes
                             + p.planner_state_bytes)
    assert p.arena_bytes == p.activation_bytes + p.scratch_bytes
    assert p.symmetric_bytes == p.routing_buffer_bytes + p.dispatch_buffer_bytes + p.combine_buffer_bytes
    assert p.scratch_bytes == p.route_scratch_bytes + p.call_scratch_pad_bytes + p.backward_scratch_bytes
    assert 0 <= p.call_scratch_pad_bytes < p.packing_granule_bytes
    assert p.activation_bytes == p.num_slots * p.slot_bytes
    assert p.peer_table_bytes == 3 * -(-ep_size * 8 // 128) * 128
    if not p.inference:
        assert p.minimum_slot_bytes == p.slot_metadata_bytes + p.layers_per_slot * p.saved_input_bytes_per_layer
        assert p.slot_metadata_bytes >= p.layers_per_slot * p.layer_metadata_bytes
        assert p.minimum_slot_bytes <= p.balanced_full_save_slot_bytes <= p.maximum_useful_slot_bytes
    for name, value in p.fields.items():
        if name.endswith("_bytes"):
            assert value % 128 == 0 or name == "packing_granule_bytes", name


def test_per_rank_combine_plan():
    route = epmoe.plan_memory(tiny_config(), 4)
    rank = epmoe.plan_memory(tiny_config(combine="per_rank"), 4)
    assert route.combine == "per_route" and rank.combine == "per_rank"
    T, D = route.tokens, route.hidden
    a = lambda n: (n + 127) // 128 * 128  # noqa: E731
    assert rank.combine_buffer_bytes == a(T * 4 * D * 2)
    assert rank.backward_scratch_bytes == route.backward_scratch_bytes + a(route.recv_capacity_rows * D * 2)
    assert "one partial row per source rank" in rank.explain()
    with pytest.raises(ValueError, match="Config.combine"):
        tiny_config(combine="per_token")


def test_fp8_wgrad_bf16_plan():
    """Config.fp8_wgrad = "bf16": x decoded to bf16 replaces the FP8 WGRAD's column operands."""
    fp8 = epmoe.plan_memory(tiny_config(precision="fp8_block", fp8_wgrad="fp8"), 4)
    bf16 = epmoe.plan_memory(tiny_config(precision="fp8_block", fp8_wgrad="bf16"), 4)
    assert fp8.fp8_wgrad == "fp8" and bf16.fp8_wgrad == "bf16"
    assert fp8.fp8_wgrad_reason == "fp8: as configured"
    assert bf16.fp8_scratch_bytes != fp8.fp8_scratch_bytes
    assert bf16.scratch_bytes - bf16.fp8_scratch_bytes == fp8.scratch_bytes - fp8.fp8_scratch_bytes
    assert "x decoded to bf16 for the bf16 WGRADs" in bf16.explain()
    assert "WGRAD columns" in fp8.explain()
    with pytest.raises(ValueError, match="Config.fp8_wgrad"):
        tiny_config(fp8_wgrad="bf16")  # precision bf16
    with pytest.raises(ValueError, match="Config.fp8_wgrad"):
        tiny_config(fp8_wgrad="fp8")  # precision bf16
    with pytest.raises(ValueError, match="Config.fp8_wgrad"):
        tiny_config(precision="fp8_block", fp8_wgrad="fp16")


def test_fp8_wgrad_by_shape_is_the_default_and_resolves_in_the_plan():
    """Config.fp8_wgrad defaults to "by_shape" with every precision; the plan holds the planner's
    choice (the tiny shape has too few rows per expert: bf16) with the requested value and the
    reason, and sizes the scratch as the explicit choice does."""
    assert epmoe.Config.__dataclass_fields__["fp8_wgrad"].default == "by_shape"
    assert tiny_config().fp8_wgrad == "by_shape"
    assert "fp8_wgrad=by_shape" in tiny_config().to_native()
    plan = epmoe.plan_memory(tiny_config(precision="fp8_block"), 4)
    assert plan.fp8_wgrad == "bf16" and plan.fp8_wgrad_requested == "by_shape"
    assert plan.fp8_wgrad_reason.startswith("bf16: ")
    assert "rows per expert < 512" in plan.fp8_wgrad_reason
    assert plan.fp8_wgrad_reason in plan.explain()
    bf16 = epmoe.plan_memory(tiny_config(precision="fp8_block", fp8_wgrad="bf16"), 4)
    assert plan.fp8_scratch_bytes == bf16.fp8_scratch_bytes and plan.total_bytes == bf16.total_bytes
    # A shape the rule gives fp8 (gpt-oss-120b at EP = 2: 512 rows per expert, D*F/(D+F) = 1440).
    big = epmoe.Config(max_num_local_input_tokens=8192, hidden_dim=2880, intermediate_dim=2880,
                       top_k=4, num_experts=128, precision="fp8_block")
    assert epmoe.plan_memory(big, 2).fp8_wgrad == "fp8"
    assert epmoe.plan_memory(big, 1).fp8_wgrad == "bf16"
    unused = epmoe.plan_memory(tiny_config(), 4)  # precision bf16: resolved to fp8, unused
    assert unused.fp8_wgrad == "fp8" and unused.fp8_wgrad_requested == "by_shape"
    explicit = epmoe.plan_memory(tiny_config(precision="fp8_block", fp8_wgrad="fp8"), 4)
    assert explicit.fp8_wgrad == explicit.fp8_wgrad_requested == "fp8"


def test_scratch_device_bytes_splits_the_arena():
    plan = epmoe.plan_memory(tiny_config(), 2)
    assert not plan.host_backed_scratch and plan.arena_host_bytes == 0
    assert plan.device_total_bytes == plan.total_bytes
    cap = plan.scratch_device_minimum_bytes + 300  # rounded down to 128
    split = epmoe.plan_memory(tiny_config(scratch_device_bytes=cap), 2)
    assert split.host_backed_scratch
    assert split.scratch_device_bytes == plan.scratch_device_minimum_bytes + 256
    assert split.arena_device_bytes + split.arena_host_bytes == split.arena_bytes == plan.arena_bytes
    assert split.arena_device_bytes == split.activation_bytes + split.scratch_device_bytes
    assert split.device_total_bytes == split.total_bytes - split.arena_host_bytes
    assert "host-backed scratch (Config.scratch_device_bytes)" in split.explain()
    with pytest.raises(ValueError, match="Config.scratch_device_bytes"):
        tiny_config(scratch_device_bytes=-1)
    with pytest.raises((ValueError, RuntimeError), match="Config.scratch_device_bytes"):
        epmoe.plan_memory(tiny_config(scratch_device_bytes=0), 2)


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


def test_explain_kernels_names_each_gemm_or_the_missing_backend():
    """explain_kernels: the CUDA backend's choice per grouped GEMM (C++ explain_cuda_kernels, host
    only), or the backend error in a build without it."""
    config = tiny_config()
    try:
        text = epmoe.explain_kernels(config, 2)
    except RuntimeError as e:
        assert "EPMOE_CUDA=ON" in str(e)
        return
    for gemm in ("w13_fprop", "w2_fprop", "w2_dgrad", "w13_dgrad", "w2_wgrad", "w13_wgrad"):
        assert f"  {gemm}: " in text
    assert f"at EP = 2: {config.local_experts(2)} local experts" in text
    with pytest.raises(ValueError, match="ep_size"):
        epmoe.explain_kernels(config, 0)
