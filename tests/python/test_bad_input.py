"""Bad input at the Python boundary: TypeError/ValueError naming the argument, raised before any
kernel runs; the context stays usable and later results are unchanged."""

import pytest
import torch

import epmoe
from conftest import D, EXPERTS, F, K, T, tiny_config
from moe_reference import make_problem


def good():
    p = make_problem(1, T, D, F, K, EXPERTS, seed=11, inactive=0.0)
    return dict(x_TD=p.x_RTD[0], topk_expert_ids_TK=p.ids_RTK[0], topk_scores_TK=p.scores_RTK[0],
                w13_weight=p.w13_GFD, w2_weight=p.w2_GDF)


def call(ctx, a):
    return epmoe.routed_experts(a["x_TD"], a["topk_expert_ids_TK"], a["topk_scores_TK"],
                                a["w13_weight"], a["w2_weight"], ctx)


def nan_score(s):
    s = s.clone()
    s[3, 1] = float("nan")
    return s


def bad_id(i):
    i = i.clone()
    i[2, 0] = EXPERTS
    return i


CASES = [
    ("x_TD", lambda t: t.float(), TypeError, "x_TD: expected dtype bfloat16, got float32"),
    ("x_TD", lambda t: t[:, :D - 8].contiguous(), ValueError, f"x_TD: expected shape [{T}, {D}]"),
    ("x_TD", lambda t: t.t().contiguous().t(), ValueError, "x_TD: expected a contiguous tensor"),
    ("x_TD", lambda t: torch.cat([t, t]), ValueError, f"x_TD: expected 1 to {T} rows"),
    ("x_TD", lambda t: t.numpy() if False else [1, 2], TypeError, "x_TD: expected a torch.Tensor"),
    ("x_TD", lambda t: t.to("meta"), ValueError, "x_TD: expected device cpu, got meta"),
    ("topk_expert_ids_TK", lambda t: t.float(), TypeError, "topk_ids_TK: expected dtype int32 or int64"),
    ("topk_expert_ids_TK", lambda t: t[:, :1].contiguous(), ValueError, "topk_ids_TK: expected shape"),
    ("topk_expert_ids_TK", bad_id, ValueError, f"topk_ids_TK: expected ids in [-1, {EXPERTS}), got {EXPERTS} at [2, 0]"),
    ("topk_scores_TK", lambda t: t.double(), TypeError, "topk_scores_TK: expected dtype float32 or bfloat16"),
    ("topk_scores_TK", nan_score, ValueError, "topk_scores_TK: expected finite scores on active routes, got nan at [3, 1]"),
    ("w13_weight", lambda t: t[:, :, :D - 8].contiguous(), ValueError, "w13_weight: expected shape"),
    ("w13_weight", lambda t: t.float(), TypeError, "w13_weight: expected dtype bfloat16"),
    ("w2_weight", lambda t: t.transpose(1, 2), ValueError, "w2_weight: expected shape"),
    ("w13_weight", lambda t: None, TypeError, "w13_weight: expected a torch.Tensor, got NoneType"),
    ("w2_weight", lambda t: t[:2].contiguous(), ValueError, f"w2_weight: expected shape [{EXPERTS}, {D}, {F}]"),
]


@pytest.mark.parametrize("arg,mutate,exc,message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_argument_names_it_and_context_survives(context, arg, mutate, exc, message):
    a = good()
    before = call(context, a)
    bad = dict(a)
    bad[arg] = mutate(a[arg])
    with pytest.raises(exc) as info:
        call(context, bad)
    assert message in str(info.value)
    assert torch.equal(call(context, a), before)


def test_nan_x_is_rejected(context):
    a = good()
    a["x_TD"] = a["x_TD"].clone()
    a["x_TD"][5, 7] = float("inf")
    with pytest.raises(ValueError, match="x_TD: expected finite values, got a NaN/Inf in row 5"):
        call(context, a)


def test_device_side_check_catches_what_the_host_skips(context):
    # validate_values=False: the host does not read the data; the CPU stages find the bad id and
    # the call raises after the step, which every rank skipped.
    a = good()
    with pytest.raises(RuntimeError, match=r"\[epmoe:invalid_routing\].*topk_ids_TK"):
        epmoe.routed_experts(a["x_TD"], bad_id(a["topk_expert_ids_TK"]), a["topk_scores_TK"],
                             a["w13_weight"], a["w2_weight"], context,
                             options=epmoe.ExecutionOptions(validate_values=False))
    assert torch.isfinite(call(context, a).float()).all()


def test_num_tokens_checked(context):
    a = good()
    with pytest.raises(TypeError, match="num_tokens: expected dtype int32"):
        epmoe.routed_experts(*a.values(), context, num_tokens=torch.tensor([3]))
    with pytest.raises(ValueError, match=r"num_tokens_1: expected a live count in \[0, 24\], got 99"):
        epmoe.routed_experts(*a.values(), context, num_tokens=torch.tensor([99], dtype=torch.int32))


def test_wrong_context_arguments():
    a = good()
    with pytest.raises(TypeError, match="context: expected epmoe.Context"):
        epmoe.routed_experts(*a.values(), 3)
    ctx = epmoe.create_context(None, tiny_config(), "cpu")
    ctx.close()
    ctx.close()  # idempotent
    with pytest.raises(ValueError, match="context: expected an open context"):
        epmoe.routed_experts(*a.values(), ctx)
    with pytest.raises(TypeError, match="use create_context"):
        epmoe.Context()


CONFIG_CASES = [
    (dict(top_k=0), ValueError, "Config.top_k: expected > 0, got 0"),
    (dict(top_k=9), ValueError, "Config.top_k: expected <= num_experts (4), got 9"),
    (dict(hidden_dim=64.0), TypeError, "Config.hidden_dim: expected an int"),
    (dict(activation="gelu"), ValueError, "Config.activation: expected one of"),
    (dict(device_scratch_capacity_factor=float("nan")), ValueError, "Config.device_scratch_capacity_factor"),
    (dict(activation_slot_bytes=1 << 20, activation_slot_capacity_factor=1.0), ValueError,
     "Config.activation_slot_bytes: expected None"),
    (dict(wgrad_dtype=torch.float16), TypeError, "Config.wgrad_dtype"),
    (dict(inference="yes"), TypeError, "Config.inference: expected a bool"),
]


@pytest.mark.parametrize("fields,exc,message", CONFIG_CASES)
def test_config_validation_names_the_field(fields, exc, message):
    with pytest.raises(exc) as info:
        tiny_config(**fields)
    assert message in str(info.value)


def test_plan_and_create_reject_bad_ep_size():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="Config.num_experts: expected a multiple of ep_size 3"):
        epmoe.plan_memory(cfg, 3)
    with pytest.raises(ValueError, match="ep_size: expected an int >= 1"):
        epmoe.plan_memory(cfg, 0)
    # The C++ planner's own checks come back as ValueError naming the field.
    with pytest.raises(ValueError, match=r"\[epmoe:invalid_argument\].*slot"):
        epmoe.plan_memory(tiny_config(activation_slot_bytes=1), 1)
