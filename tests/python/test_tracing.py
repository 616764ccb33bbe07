"""The graph boundary: torch.compile(fullgraph=True) with no graph break, make_fx, opcheck of every
op, and the ordered effect that keeps a collective whose result is unused."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import epmoe
from conftest import D, EXPERTS, F, K, T, tiny_config
from moe_reference import make_problem


class MoE(torch.nn.Module):
    """A model-shaped module: router outside, routed experts through epmoe."""

    def __init__(self, context, w13, w2):
        super().__init__()
        self.context = context
        self.w13 = torch.nn.Parameter(w13.clone())
        self.w2 = torch.nn.Parameter(w2.clone())

    def forward(self, x, ids, scores):
        return x + epmoe.routed_experts(x, ids, scores, self.w13, self.w2, self.context)


def _problem(seed=21):
    return make_problem(1, T, D, F, K, EXPERTS, seed=seed)


def test_compile_fullgraph_matches_eager_forward_and_backward():
    ctx = epmoe.create_context(None, tiny_config(max_moe_layers_per_activation_slot=2), "cpu")
    try:
        p = _problem()
        eager, compiled_model = MoE(ctx, p.w13_GFD, p.w2_GDF), MoE(ctx, p.w13_GFD, p.w2_GDF)
        compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
        xs = [p.x_RTD[0].clone().requires_grad_() for _ in range(2)]
        s = [p.scores_RTK[0].clone().requires_grad_() for _ in range(2)]
        y_e = eager(xs[0], p.ids_RTK[0], s[0])
        y_c = compiled(xs[1], p.ids_RTK[0], s[1])
        assert torch.equal(y_e, y_c)
        y_e.backward(p.grad_y_RTD[0])
        y_c.backward(p.grad_y_RTD[0])
        assert torch.equal(xs[0].grad, xs[1].grad)
        assert torch.equal(s[0].grad, s[1].grad)
        assert torch.equal(eager.w13.grad, compiled_model.w13.grad)
        assert torch.equal(eager.w2.grad, compiled_model.w2.grad)
    finally:
        ctx.close()


def test_no_graph_break(context):
    p = _problem()
    model = MoE(context, p.w13_GFD, p.w2_GDF)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0])
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_compile_with_inductor_matches_eager(context):
    p = _problem(22)
    model = MoE(context, p.w13_GFD, p.w2_GDF)
    with torch.no_grad():
        want = model(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0])
        got = torch.compile(model, fullgraph=True)(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0])
    assert torch.equal(want, got)


def test_make_fx_keeps_both_calls_in_order(context):
    p = _problem(23)

    def two_layers(x, ids, scores, w13, w2):
        unused = epmoe.routed_experts(x, ids, scores, w13, w2, context)  # noqa: F841
        return epmoe.routed_experts(x, ids, scores, w13, w2, context)

    args = (p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF)
    gm = make_fx(two_layers)(*args)
    calls = [n for n in gm.graph.nodes if "routed_experts_fwd" in str(n.target)]
    assert len(calls) == 2
    assert torch.equal(gm(*args), two_layers(*args))


def test_compile_keeps_a_collective_whose_result_is_unused():
    # The effect token orders both calls; without it the first one would be dead code.
    captured = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def fw(g, _inputs):
            captured.append(g)
            return g

        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    ctx = epmoe.create_context(None, tiny_config(), "cpu")
    try:
        p = _problem(24)

        def f(x, ids, scores, w13, w2):
            epmoe.routed_experts(x, ids, scores, w13, w2, ctx)
            return epmoe.routed_experts(x, ids, scores, w13, w2, ctx) * 2

        with torch.no_grad():
            torch.compile(f, backend=backend, fullgraph=True)(
                p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF)
        text = captured[0].code
        assert text.count("epmoe.routed_experts_fwd") == 2, text
        assert "with_effects" in text, text
    finally:
        ctx.close()


# ---- opcheck: schema, fake kernel, autograd registration, AOT dispatch -------------------------

def _opcheck_context(**kw):
    return epmoe.create_context(None, tiny_config(max_moe_layers_per_activation_slot=64, **kw), "cpu")


def test_opcheck_routed_experts_fwd():
    ctx = _opcheck_context()
    try:
        p = _problem(25)
        args = (p.x_RTD[0].clone().requires_grad_(), p.ids_RTK[0], p.scores_RTK[0].clone().requires_grad_(),
                p.w13_GFD.clone().requires_grad_(), p.w2_GDF.clone().requires_grad_(), None, ctx.id, True, 0)
        torch.library.opcheck(torch.ops.epmoe.routed_experts_fwd.default, args)
    finally:
        ctx.close()


def test_opcheck_routed_experts_bwd():
    ctx = _opcheck_context()
    try:
        p = _problem(26)
        fwd = (p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, None, ctx.id, True, 0)
        for _ in range(32):  # every opcheck call of the backward consumes one saved forward
            torch.ops.epmoe.routed_experts_fwd(*fwd)
        args = (p.grad_y_RTD[0], p.ids_RTK[0], p.scores_RTK[0], p.w13_GFD, p.w2_GDF, None, ctx.id, 0)
        torch.library.opcheck(torch.ops.epmoe.routed_experts_bwd.default, args)
    finally:
        ctx.close()


def _layered_inputs(ctx, seed):
    p = _problem(seed)
    recv, layout = torch.ops.epmoe.dispatch(p.x_RTD[0], p.ids_RTK[0], p.scores_RTK[0], None, ctx.id)
    return p, recv, layout


def test_opcheck_layered_ops():
    ctx = _opcheck_context()
    try:
        p, recv, layout = _layered_inputs(ctx, 27)
        M = ctx.capacity_rows
        ids, scores = p.ids_RTK[0], p.scores_RTK[0]
        op = torch.ops.epmoe
        torch.library.opcheck(op.dispatch.default, (p.x_RTD[0].clone().requires_grad_(), ids, scores, None, ctx.id))
        h13 = op.grouped_gemm(recv, p.w13_GFD, layout, ctx.id)
        h = (torch.nn.functional.silu(h13[:, :F].float()) * h13[:, F:].float()).bfloat16()
        torch.library.opcheck(op.grouped_gemm.default,
                              (recv.clone().requires_grad_(), p.w13_GFD.clone().requires_grad_(), layout, ctx.id))
        torch.library.opcheck(op.grouped_gemm.default,
                              (h.clone().requires_grad_(), p.w2_GDF.clone().requires_grad_(), layout, ctx.id))
        g = torch.randn(M, 2 * F).bfloat16()
        torch.library.opcheck(op.grouped_gemm_backward.default, (g, recv, p.w13_GFD, layout, ctx.id))
        rows = op.grouped_gemm(h, p.w2_GDF, layout, ctx.id)
        torch.library.opcheck(op.combine.default,
                              (rows.clone().requires_grad_(), layout, ids, scores.clone().requires_grad_(), ctx.id, True))
        _, rows_TKD = op.combine(rows, layout, ids, scores, ctx.id, True)
        torch.library.opcheck(op.combine_backward.default,
                              (p.grad_y_RTD[0], layout, ids, scores, rows_TKD, ctx.id))
        torch.library.opcheck(op.dispatch_backward.default, (recv, layout, ids, ctx.id))
    finally:
        ctx.close()


def test_layered_ops_compile_fullgraph_and_match_eager(context):
    p = _problem(28)

    def layered(x, ids, s, w13, w2):
        recv, handle = epmoe.dispatch(x, ids, s, context)
        h13 = epmoe.grouped_gemm(recv, w13, handle)
        h = (torch.nn.functional.silu(h13[:, :F].float()) * h13[:, F:].float()).bfloat16()
        return epmoe.combine(epmoe.grouped_gemm(h, w2, handle), handle)

    def leaves():
        return [p.x_RTD[0].clone().requires_grad_(), p.ids_RTK[0], p.scores_RTK[0].clone().requires_grad_(),
                p.w13_GFD.clone().requires_grad_(), p.w2_GDF.clone().requires_grad_()]

    eager_args, compiled_args = leaves(), leaves()
    y_e = layered(*eager_args)
    y_c = torch.compile(layered, fullgraph=True, backend="aot_eager")(*compiled_args)
    assert torch.equal(y_e, y_c)
    y_e.backward(p.grad_y_RTD[0])
    y_c.backward(p.grad_y_RTD[0])
    for a, b in zip(eager_args, compiled_args):
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)
