"""The EP = 2 benchmark's accounting (pure: the rows and bytes each rank moves, the bandwidth and
bound figures from stage times, the step statistics) and the object gather over a gloo group.
bench_ep.py times; ep_self_check.py checks these on CPU ranks."""
import pickle
import statistics

import torch
import torch.distributed as dist


def routes_to_ranks(ids, E_local, R):
    """[R] int64: routes of these tokens to each rank's experts (inactive routes left out)."""
    flat = ids.reshape(-1).long()
    return torch.bincount(flat[flat >= 0] // E_local, minlength=R).cpu()


def tokens_to_ranks(ids, E_local, R):
    """[R] int64: tokens with at least one route to each rank's experts."""
    dest = torch.where(ids >= 0, ids.long() // E_local, R)  # R: inactive
    hit = torch.zeros(ids.shape[0], R + 1, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, dest, True)
    return hit[:, :R].sum(0).cpu()


def traffic(C_RR, tokens_RR=None):
    """C_RR[s][d]: routes of rank s's tokens to rank d's experts (tokens_RR[s][d]: tokens with a
    route there). Per rank d: received rows (all routes it computes) and the routes from other
    ranks (= rows it stores back into their combine slots); busiest received rows and the balanced
    share; with tokens_RR, the (token, rank) pairs from other ranks: the rows dispatch and
    gather_grad read from peers (one read per source rank and token); local_token_rows: this
    rank's own tokens with a route here; served_token_rows: (token, other rank) pairs of this
    rank's tokens (rows peers read from it; per-rank combine rows they send back)."""
    R = len(C_RR)
    received = [sum(C_RR[s][d] for s in range(R)) for d in range(R)]
    remote = [received[d] - C_RR[d][d] for d in range(R)]
    out = {"received_rows": received, "remote_rows": remote, "busiest_rank_rows": max(received),
           "balanced_rows": sum(received) // R}
    if tokens_RR is not None:
        out["remote_token_rows"] = [sum(tokens_RR[s][d] for s in range(R) if s != d)
                                    for d in range(R)]
        out["local_token_rows"] = [tokens_RR[d][d] for d in range(R)]
        out["served_token_rows"] = [sum(tokens_RR[d][s] for s in range(R) if s != d)
                                    for d in range(R)]
    return out


def per_rank_bound_ms(tr, D, peer_GBps, hbm_GBps, elem_bytes=2):
    """Beside dispatch_combine_GBps (which counts remote bytes only): the time each rank's
    dispatch (or gather_grad) + per-rank combine_send cannot beat, from every byte they move. Per
    stage and rank: max(bytes sent over NVLink, bytes received over NVLink) / peer stores (both
    directions at once) vs the rank's HBM bytes / HBM copy (read + write bytes). Dispatch on rank
    r reads its local tokens' rows and the rows peers pull from it and writes every received row;
    combine_send reads every received row and writes its own tokens' partials and the ones peers
    send it. The backward's 4-byte grad_scores are left out. Returns [ms per rank] of one phase
    (the two stages added: they run one after the other)."""
    out = []
    for r in range(len(tr["received_rows"])):
        row_bytes = D * elem_bytes
        own, served = tr["local_token_rows"][r], tr["served_token_rows"][r]
        link = max(tr["remote_token_rows"][r], served) * row_bytes / (peer_GBps * 1e6)
        hbm = (own + served + tr["received_rows"][r]) * row_bytes / (hbm_GBps * 1e6)
        out.append(2 * max(link, hbm))  # dispatch and combine_send move the same bytes
    return out


def dispatch_combine_GBps(stage_lists, remote_rows, remote_token_rows, D, elem_bytes=2,
                          per_rank=False):
    """Dispatch + combine bandwidth from each rank's stage times (forward then backward, in launch
    order): forward dispatch + the combine stage, backward gather_grad + the combine stage. Per
    phase rank r moves remote_token_rows[r] rows of D elements in dispatch / gather_grad (one read
    per source token) and, in the combine, remote_rows[r] rows (per route: scatter_rows of the
    unfused chain) or, per_rank, remote_token_rows[r] rows (combine_send: one per token and rank)
    plus, backward, remote_rows[r] fp32 grad_scores (4 bytes each, stored by gather_grad): the
    bytes that cross between GPUs in each mode.
    Returns {phase: (GBps over ranks = sum bytes / sum time, [GBps per rank], [ms per rank])}."""
    out = {}
    combine = "combine_send" if per_rank else "scatter_rows"
    for phase, names in (("dispatch+combine", ("dispatch", combine)),
                         ("dispatch+combine-bwd", ("gather_grad", combine))):
        ms_R, gbps_R, total_bytes, total_ms = [], [], 0, 0.0
        for r, stages in enumerate(stage_lists):
            cut = [i for i, (n, _) in enumerate(stages) if n == "reduce_forward"][0] + 1
            part = stages[:cut] if phase == "dispatch+combine" else stages[cut:]
            ms = sum(t for n, t in part if n in names)
            combine_rows = remote_token_rows[r] if per_rank else remote_rows[r]
            nbytes = (remote_token_rows[r] + combine_rows) * D * elem_bytes
            if per_rank and phase == "dispatch+combine-bwd":
                nbytes += remote_rows[r] * 4
            ms_R.append(ms)
            gbps_R.append(nbytes / ms / 1e6 if ms > 0 else None)
            total_bytes += nbytes
            total_ms += ms
        out[phase] = (total_bytes / total_ms / 1e6 if total_ms > 0 else None, gbps_R, ms_R)
    return out


def step_stats(times_R):
    """times_R[r][i]: rank r's time of iteration i. Step time = max over ranks per iteration."""
    steps = [max(t) for t in zip(*times_R)]
    return statistics.median(steps), min(steps), max(steps)


def gather_objects(obj, group=None):
    """obj of every rank, in rank order, on every rank: pickled bytes in CPU tensors over a gloo
    group (all_gather_object needs numpy, which the test environment lacks)."""
    size = dist.get_world_size(group)
    data = torch.tensor(list(pickle.dumps(obj)), dtype=torch.uint8)
    n_R = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(n_R, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(n) for n in n_R)
    buf_R = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(buf_R, torch.cat([data, torch.zeros(longest - data.numel(), dtype=torch.uint8)]),
                    group=group)
    return [pickle.loads(bytes(b[:int(n)].tolist())) for b, n in zip(buf_R, n_R)]
