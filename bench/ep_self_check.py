"""bench_ep.py --self-check: on CPU ranks (gloo), the EP recipe (bench/torch_recipe.py, and its
FP8 form where torch can emulate it) against the one-process recipe on the concatenated batch,
and ep_accounting.py's figures against brute force and worked numbers."""
import sys

import torch
import torch.distributed as dist

import measure
import shapes as S
import torch_recipe
import torch_recipe_fp8
from ep_accounting import (dispatch_combine_GBps, gather_objects, per_rank_bound_ms, routes_to_ranks,
                           step_stats, tokens_to_ranks, traffic)


def fp8_cpu_reason():
    """None where the FP8 recipe's EP math can be checked on CPU (its fp8 GEMM emulated), else
    why not."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch.float8_e4m3fn"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (the recipe's backward GEMMs)"
    return None


def ep_against_one_process(rank, R, x, ids, scores, w13, w2, grad_y, forward, forward_ep):
    """Forward and backward of forward_ep(x, ids, scores, w13, w2) on this rank's tokens and
    experts against forward(...) on the concatenated batch of every rank and all experts. Returns
    ({name: rel-L2} of y and the four gradients, this rank's y)."""
    T, D = x.shape[1], x.shape[2]
    K = ids.shape[2]
    El = w13.shape[0] // R
    mine = slice(rank * El, (rank + 1) * El)
    tokens = slice(rank * T, (rank + 1) * T)

    def leaves(*ts):
        return [t.clone().requires_grad_() for t in ts]

    xa, sa, w13a, w2a = leaves(x.reshape(R * T, D), scores.reshape(R * T, K), w13, w2)
    ya = forward(xa, ids.reshape(R * T, K), sa, w13a, w2a)
    ya.backward(grad_y.reshape(R * T, D))
    xe, se, w13e, w2e = leaves(x[rank], scores[rank], w13[mine], w2[mine])
    ye = forward_ep(xe, ids[rank], se, w13e, w2e)
    ye.backward(grad_y[rank])
    pairs = {"y": (ye, ya[tokens]), "grad_x": (xe.grad, xa.grad[tokens]),
             "grad_scores": (se.grad, sa.grad[tokens]), "grad_w13": (w13e.grad, w13a.grad[mine]),
             "grad_w2": (w2e.grad, w2a.grad[mine])}
    return {k: measure.rel_l2(a.detach(), b.detach()) for k, (a, b) in pairs.items()}, ye


def self_check_fp8(rank, R, x, ids, scores, w13, w2, grad_y, ye_bf16):
    """The FP8 EP recipe (torch_recipe_fp8.moe_forward_ep, the fp8 GEMM emulated on CPU) against
    the one-process FP8 recipe on the concatenated batch, both with the weights quantized per
    expert and output channel (so rank-local preparation equals the global one's slice); and
    against the bf16 EP recipe: close, but not equal (the quantization ran). Returns
    ({name: rel-L2}, rel-L2 of y vs bf16, [failed checks])."""
    R8 = torch_recipe_fp8
    El = w13.shape[0] // R
    mine = slice(rank * El, (rank + 1) * El)
    every = (R8.quantize_weights(w13), R8.quantize_weights(w2))
    local = (R8.quantize_weights(w13[mine]), R8.quantize_weights(w2[mine]))
    err, ye = ep_against_one_process(rank, R, x, ids, scores, w13, w2, grad_y,
                                     lambda *a: R8.moe_forward(*a, every),
                                     lambda *a: R8.moe_forward_ep(*a, local))
    bad = [f"fp8 {k}" for k, v in err.items() if not v <= 1e-2]
    vs_bf16 = measure.rel_l2(ye.detach(), ye_bf16.detach())
    # e4m3 operands of two chained GEMMs: a few % from bf16 (test_torch_recipe_fp8.py)
    if not 1e-3 < vs_bf16 < 0.12:
        bad.append("fp8 y vs bf16 within (1e-3, 0.12)")
    return err, vs_bf16, bad


def self_check():
    dist.init_process_group("gloo")
    rank, R = dist.get_rank(), dist.get_world_size()
    T, D, F, E, K = 48, 64, 32, 8, 3
    El = E // R
    failures = 0
    fp8_reason = fp8_cpu_reason()
    if fp8_reason:
        print(f"self-check fp8: skipped ({fp8_reason})", flush=True)
    else:
        # torch._scaled_grouped_mm has no CPU kernel: its CPU twin (same quantization, fp32 GEMM)
        torch_recipe_fp8.ScaledGroupedMm.mm = staticmethod(torch_recipe_fp8.emulated_scaled_grouped_mm)
    for routing in ("balanced", "skew", "empty-rank", "one-expert"):
        g = torch.Generator().manual_seed(7)  # the same global problem on every rank
        x = torch.randn(R, T, D, generator=g).to(torch.bfloat16)
        w13 = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(torch.bfloat16)
        ids, scores = zip(*[S.route(routing, T, E, K, ep=R, generator=g, device="cpu")
                            for _ in range(R)])
        ids, scores = torch.stack(ids), torch.stack(scores)
        ids[0, :5, -1] = -1  # a few inactive routes
        grad_y = torch.randn(R, T, D, generator=g).to(torch.bfloat16)

        err, ye = ep_against_one_process(rank, R, x, ids, scores, w13, w2, grad_y,
                                         torch_recipe.moe_forward, torch_recipe.moe_forward_ep)
        bad = [k for k, v in err.items() if not v <= 1e-2]

        # Accounting: traffic of the global routing by brute force.
        C = [routes_to_ranks(ids[s], El, R).tolist() for s in range(R)]
        tok = [tokens_to_ranks(ids[s], El, R).tolist() for s in range(R)]
        brute = [[int(((ids[s] >= 0) & (ids[s] // El == d)).sum()) for d in range(R)] for s in range(R)]
        brute_tok = [[int(((ids[s] >= 0) & (ids[s] // El == d)).any(1).sum()) for d in range(R)]
                     for s in range(R)]
        tr = traffic(C, tok)
        if C != brute or tok != brute_tok or sum(tr["received_rows"]) != int((ids >= 0).sum()):
            bad.append("traffic")
        if any(t > r for t, r in zip(tr["remote_token_rows"], tr["remote_rows"])):
            bad.append("remote token rows <= remote rows")
        if routing == "skew" and not tr["busiest_rank_rows"] > 1.5 * tr["balanced_rows"]:
            bad.append("skew at EP = 2 sends most routes to rank 0")
        print(f"self-check rank {rank} {routing}: rel-L2 EP recipe vs one-process recipe " +
              ", ".join(f"{k} {v:.1e}" for k, v in err.items()) +
              f"; received rows {tr['received_rows']}, from the other rank {tr['remote_rows']} "
              f"({tr['remote_token_rows']} tokens)" + (f"; FAILED: {bad}" if bad else ""),
              flush=True)
        failures += len(bad)
        if not fp8_reason:
            err8, vs_bf16, bad8 = self_check_fp8(rank, R, x, ids, scores, w13, w2, grad_y, ye)
            print(f"self-check fp8 rank {rank} {routing}: rel-L2 EP fp8 recipe vs one-process fp8 "
                  "recipe " + ", ".join(f"{k} {v:.1e}" for k, v in err8.items()) +
                  f"; y vs bf16 EP recipe {vs_bf16:.1e}" + (f"; FAILED: {bad8}" if bad8 else ""),
                  flush=True)
            failures += len(bad8)
    # Stage-time bandwidth and step statistics on made-up numbers.
    st = [[("dispatch", 1.0), ("scatter_rows", 1.0), ("reduce_forward", 0.1), ("gather_grad", 2.0),
           ("scatter_rows", 2.0)]] * 2
    bw = dispatch_combine_GBps(st, [1000, 500], [600, 400], 1024)
    want = (1500 + 1000) * 1024 * 2 / 4.0 / 1e6
    if abs(bw["dispatch+combine"][0] - want) > 1e-9 or bw["dispatch+combine-bwd"][2] != [4.0, 4.0]:
        print(f"self-check: dispatch_combine_GBps FAILED: {bw}", flush=True)
        failures += 1
    st = [[("dispatch", 1.0), ("combine_send", 1.0), ("reduce_forward", 0.1), ("gather_grad", 2.0),
           ("combine_send", 2.0)]] * 2
    bw = dispatch_combine_GBps(st, [1000, 500], [600, 400], 1024, per_rank=True)
    want_fwd = (600 + 600 + 400 + 400) * 1024 * 2 / 4.0 / 1e6
    want_bwd = ((600 + 600 + 400 + 400) * 1024 * 2 + (1000 + 500) * 4) / 8.0 / 1e6
    if (abs(bw["dispatch+combine"][0] - want_fwd) > 1e-9 or
            abs(bw["dispatch+combine-bwd"][0] - want_bwd) > 1e-9):
        print(f"self-check: dispatch_combine_GBps per_rank FAILED: {bw}", flush=True)
        failures += 1
    tr = traffic([[700, 300], [200, 800]], [[500, 250], [150, 600]])
    got = per_rank_bound_ms(tr, 1000, 100.0, 1000.0)
    # rank 0: link max(150, 250) * 2000 B / 1e8 B/ms = 5 us, HBM (500 + 250 + 900) * 2000 / 1e9
    # = 3.3 us; rank 1: link 5 us, HBM (600 + 150 + 1100) * 2000 / 1e9 = 3.7 us; twice (2 stages).
    if (tr["local_token_rows"] != [500, 600] or tr["served_token_rows"] != [250, 150] or
            any(abs(a - b) > 1e-12 for a, b in zip(got, [0.010, 0.010]))):
        print(f"self-check: per_rank_bound_ms FAILED: {got} {tr}", flush=True)
        failures += 1
    got = per_rank_bound_ms(tr, 1000, 1000.0, 100.0)  # HBM-bound: 33 us and 37 us, twice
    if any(abs(a - b) > 1e-12 for a, b in zip(got, [0.066, 0.074])):
        print(f"self-check: per_rank_bound_ms (HBM) FAILED: {got}", flush=True)
        failures += 1
    if step_stats([[1.0, 5.0, 3.0], [2.0, 4.0, 3.5]]) != (3.5, 2.0, 5.0):
        print("self-check: step_stats FAILED", flush=True)
        failures += 1
    total = gather_objects(failures)
    dist.destroy_process_group()
    if rank == 0:
        print(f"self-check: {'passed' if sum(total) == 0 else 'FAILED'}", flush=True)
    sys.exit(1 if sum(total) else 0)
