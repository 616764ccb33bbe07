"""Helpers the integrations share: process groups from meshes, expert sharding, a plain-torch
experts forward (the unsharded reference and the fallback where epmoe cannot run)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as Fn


def group_of(mesh):
    """A ProcessGroup from a DeviceMesh (1-D), a ProcessGroup, or None (one rank)."""
    if mesh is None:
        return None
    get_group = getattr(mesh, "get_group", None)
    return get_group() if callable(get_group) else mesh


def is_device_mesh(mesh) -> bool:
    return mesh is not None and callable(getattr(mesh, "get_group", None))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor parameter (differentiable), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def expert_shard(full: torch.Tensor, rank: int, size: int, name: str) -> torch.Tensor:
    """Rank r's contiguous block of experts (dim 0), as epmoe's layout requires (Shard(0))."""
    E = full.shape[0]
    if E % size != 0:
        raise ValueError(f"{name}: expected a number of experts divisible by the EP size {size}, got {E}")
    n = E // size
    return full[rank * n:(rank + 1) * n].contiguous()


def pad_rows(t: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    if t.shape[0] > rows:
        raise ValueError(f"tokens: expected at most {rows} rows (the context's max_num_local_input_tokens), "
                         f"got {t.shape[0]}")
    return Fn.pad(t, (0, 0, 0, rows - t.shape[0]), value=value)


def eager_experts(x_TD: torch.Tensor, ids_TK: torch.Tensor, scores_TK: torch.Tensor,
                  w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, first_expert: int = 0,
                  activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """sum_k score * W2_e(SwiGLU(W13_e x)) in fp32 over the experts held here ([first_expert,
    first_expert + E)); routes to other experts and id -1 contribute nothing."""
    F = w2_EDF.shape[2]
    x = x_TD.float()
    y = torch.zeros_like(x)
    for e in range(w13_EFD.shape[0]):
        hit = ids_TK == first_expert + e
        tok, k = hit.nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h13 = x[tok] @ w13_EFD[e].float().t()
        gate, up = h13[:, :F], h13[:, F:]
        if activation == "swiglu_clamped":
            gate = gate.clamp(max=limit)
            up = up.clamp(-limit, limit)
            h = gate * torch.sigmoid(alpha * gate) * (up + 1)
        else:
            h = Fn.silu(gate) * up
        out = h @ w2_EDF[e].float().t()
        y = y.index_add(0, tok, out * scores_TK[tok, k].float().unsqueeze(1))
    return y.to(x_TD.dtype)


def supported(device: torch.device, dtype: torch.dtype, ep_size: int) -> tuple[bool, str]:
    """Whether epmoe can run this layer here, and why not."""
    if dtype != torch.bfloat16:
        return False, f"epmoe computes in bfloat16, the experts are {dtype}"
    if device.type == "cuda":
        if torch.ops.epmoe._cuda_device_count() == 0:
            return False, "epmoe was built without CUDA (or sees no GPU)"
        if ep_size > 1 and not torch.ops.epmoe._has_nccl():
            return False, "multi-GPU EP needs the NCCL transport, which this build of epmoe lacks"
        return True, "one GPU"
    if device.type == "cpu":
        return True, "CPU ranks (threads in one process or processes sharing memory)"
    return False, f"no epmoe backend for {device.type}"


def optional_int(name: str, v) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v
