"""The torch-native MoE recipe of MEASURE.md (what TorchTitan users run), EP = 1: argsort routes by
expert, counts read on the host, regroup, pad each expert to 16 rows, torch._grouped_mm for W13
and W2 with SwiGLU between, unpad, index_add weighted by scores. Backward is torch autograd."""
import torch
import torch.nn.functional as F

ALIGN = 16


def permute(ids, E):
    """Row order grouped by expert, padded per expert to ALIGN rows (host sync: counts)."""
    flat = ids.reshape(-1).long()
    active = flat >= 0
    order = torch.argsort(torch.where(active, flat, E), stable=True)
    counts = torch.bincount(flat[active], minlength=E)
    counts_host = counts.tolist()  # the host read every such recipe does
    padded = [(c + ALIGN - 1) // ALIGN * ALIGN for c in counts_host]
    if sum(padded) == 0:
        padded[0] = ALIGN
    offs = torch.tensor(padded, device=ids.device).cumsum(0).to(torch.int32)
    # destination row of each active route in the padded layout
    starts = offs - torch.tensor(padded, device=ids.device, dtype=torch.int32)
    n_active = int(sum(counts_host))
    order = order[:n_active]
    expert_of = flat[order]
    rank_in_expert = torch.arange(n_active, device=ids.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts)
    dst = starts.long()[expert_of] + rank_in_expert
    return order, dst, offs, sum(padded)


def swiglu(h13, clamped=False, alpha=1.702, limit=7.0):
    gate, up = h13.chunk(2, dim=-1)
    if clamped:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    return F.silu(gate) * up


def moe_forward(x, ids, scores, w13, w2, clamped=False):
    """y [T, D] = sum_k score * W2(SwiGLU(W13 x)). w13 [E, 2F, D], w2 [E, D, F]."""
    T, K = ids.shape
    E = w13.shape[0]
    order, dst, offs, rows = permute(ids, E)
    tok = order // K
    xp = x.new_zeros(rows, x.shape[1])
    xp = xp.index_copy(0, dst, x[tok])
    h13 = torch._grouped_mm(xp, w13.transpose(-2, -1), offs=offs)
    h = swiglu(h13, clamped)
    out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    routed = out[dst].float() * scores.reshape(-1)[order].unsqueeze(1).float()
    y = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32).index_add(0, tok, routed)
    return y.to(x.dtype)
