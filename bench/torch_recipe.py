"""The torch-native MoE recipe of MEASURE.md (what TorchTitan users run), EP = 1 and EP = R.
EP = 1: argsort routes by expert, counts read on the host, regroup, pad each expert to 16 rows,
torch._grouped_mm for W13 and W2 with SwiGLU between, unpad, index_add weighted by scores.
EP = R (moe_forward_ep): the same with the rows sent to the experts' owners and back by
all_to_all_single (autograd), the split sizes read on the host. Backward is torch autograd.
moe_forward_ep takes the expert GEMMs as a function, so that the FP8 recipe (torch_recipe_fp8.py)
runs the same dispatch and combine."""
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F

ALIGN = 16


def group_rows(expert_N, counts_E, counts_host, E):
    """Rows grouped by expert, each expert padded to ALIGN rows. expert_N [N]: expert of each row
    (< 0: inactive, left out); counts_E [E]: rows per expert (device), counts_host: the same on the
    host. Returns the stable order of the active rows by expert, the padded row of each of them,
    the group end offsets (int32) and the padded row count."""
    order = torch.argsort(torch.where(expert_N >= 0, expert_N, E), stable=True)
    padded = [(c + ALIGN - 1) // ALIGN * ALIGN for c in counts_host]
    if sum(padded) == 0:
        padded[0] = ALIGN
    offs = torch.tensor(padded, device=expert_N.device).cumsum(0).to(torch.int32)
    starts = offs - torch.tensor(padded, device=expert_N.device, dtype=torch.int32)
    n_active = int(sum(counts_host))
    order = order[:n_active]
    expert_of = expert_N[order]
    rank_in_expert = torch.arange(n_active, device=expert_N.device) - torch.repeat_interleave(
        torch.cumsum(counts_E, 0) - counts_E, counts_E, output_size=n_active)
    dst = starts.long()[expert_of] + rank_in_expert
    return order, dst, offs, sum(padded)


def permute(ids, E):
    """Row order grouped by expert, padded per expert to ALIGN rows (host sync: counts)."""
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat[flat >= 0], minlength=E)
    return group_rows(flat, counts, counts.tolist(), E)  # the host read every such recipe does


def swiglu(h13, clamped=False, alpha=1.702, limit=7.0):
    gate, up = h13.chunk(2, dim=-1)
    if clamped:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    return F.silu(gate) * up


def experts(xp, offs, w13, w2, clamped=False):
    """Grouped rows xp [padded, D] through W2(SwiGLU(W13 x)) of each group."""
    h13 = torch._grouped_mm(xp, w13.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(swiglu(h13, clamped), w2.transpose(-2, -1), offs=offs)


def combine(rows_ND, tok_N, scores_N, T):
    """y [T, D] = sum of the rows of each token weighted by their scores (fp32 sums)."""
    routed = rows_ND.float() * scores_N.unsqueeze(1).float()
    y = torch.zeros(T, rows_ND.shape[1], device=rows_ND.device, dtype=torch.float32)
    return y.index_add(0, tok_N, routed).to(rows_ND.dtype)


def moe_forward(x, ids, scores, w13, w2, clamped=False):
    """y [T, D] = sum_k score * W2(SwiGLU(W13 x)). w13 [E, 2F, D], w2 [E, D, F]."""
    T, K = ids.shape
    E = w13.shape[0]
    order, dst, offs, rows = permute(ids, E)
    tok = order // K
    xp = x.new_zeros(rows, x.shape[1]).index_copy(0, dst, x[tok])
    out = experts(xp, offs, w13, w2, clamped)
    return combine(out[dst], tok, scores.reshape(-1)[order], T)


def moe_forward_ep(x, ids, scores, w13, w2, group=None, clamped=False, experts_fn=None):
    """EP = R recipe on this rank. x [T, D] this rank's tokens, ids [T, K] global expert ids in
    [0, E * R) (-1 inactive), w13 [E, 2F, D] / w2 [E, D, F] this rank's experts (rank r owns
    [r * E, (r + 1) * E)). Routes sorted by global expert are sorted by destination rank; the
    counts per (rank, expert) cross in one all_to_all_single and are read on the host once.
    experts_fn(xp, offs): the local experts on the grouped rows (default: experts in bf16)."""
    R = dist.get_world_size(group)
    T, K = ids.shape
    E, D = w13.shape[0], x.shape[1]
    flat = ids.reshape(-1).long()
    active = flat >= 0
    order = torch.argsort(torch.where(active, flat, E * R), stable=True)
    send_counts = torch.bincount(flat[active], minlength=E * R)  # [R * E] by (destination, expert)
    recv_counts = torch.empty_like(send_counts)  # [R * E] by (source, local expert)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_host, recv_host = torch.stack([send_counts, recv_counts]).tolist()  # the host read
    input_splits = [sum(send_host[r * E:(r + 1) * E]) for r in range(R)]
    output_splits = [sum(recv_host[r * E:(r + 1) * E]) for r in range(R)]
    n_send, n_recv = sum(input_splits), sum(output_splits)
    order = order[:n_send]
    tok = order // K
    recv_x = dist_fn.all_to_all_single(x.new_empty(n_recv, D), x[tok], output_splits, input_splits,
                                       group=group)
    # Regroup the received rows (by source, then expert) by local expert, padded per expert.
    expert_recv = torch.arange(E, device=x.device).repeat(R).repeat_interleave(
        recv_counts, output_size=n_recv)
    local_host = [sum(recv_host[r * E + e] for r in range(R)) for e in range(E)]
    perm, dst, offs, rows = group_rows(expert_recv, recv_counts.view(R, E).sum(0), local_host, E)
    dst_recv = torch.empty_like(dst)
    dst_recv[perm] = dst  # padded row of each received row
    xp = recv_x.new_zeros(rows, D).index_copy(0, dst_recv, recv_x)
    out = experts_fn(xp, offs) if experts_fn else experts(xp, offs, w13, w2, clamped)
    back = dist_fn.all_to_all_single(x.new_empty(n_send, D), out[dst_recv], input_splits,
                                     output_splits, group=group)
    return combine(back, tok, scores.reshape(-1)[order], T)
