"""Inputs and a float64 reference of the routed-experts layer, shared by the tests and the
multi-process workers. Inputs are random (never zeros) and reproducible from a seed."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Problem:
    x_RTD: torch.Tensor  # bf16 [R, T, D]: rank r's tokens are x_RTD[r]
    ids_RTK: torch.Tensor  # int32 [R, T, K], global ids, distinct per token, some -1
    scores_RTK: torch.Tensor  # f32 [R, T, K]
    w13_GFD: torch.Tensor  # bf16 [E*R, 2F, D]: every global expert
    w2_GDF: torch.Tensor  # bf16 [E*R, D, F]
    grad_y_RTD: torch.Tensor  # bf16 [R, T, D]

    def rank_weights(self, rank: int, ep_size: int):
        E = self.w13_GFD.shape[0] // ep_size
        return (self.w13_GFD[rank * E:(rank + 1) * E].contiguous(),
                self.w2_GDF[rank * E:(rank + 1) * E].contiguous())


def make_problem(R: int, T: int, D: int, F: int, K: int, experts: int, seed: int = 0,
                 routing: str = "random", inactive: float = 0.1) -> Problem:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, T, D, generator=g) * 0.5).bfloat16()
    if routing == "one-expert":  # every route of k = 0 to expert 0, the rest inactive
        ids = torch.full((R, T, K), -1, dtype=torch.int32)
        ids[..., 0] = 0
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(R * T)])
        ids = ids.view(R, T, K).int()
        drop = torch.rand(R, T, K, generator=g) < inactive
        ids[drop] = -1
    scores = torch.rand(R, T, K, generator=g) + 0.1
    w13 = (torch.randn(experts, 2 * F, D, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(experts, D, F, generator=g) / F ** 0.5).bfloat16()
    gy = torch.randn(R, T, D, generator=g).bfloat16()
    return Problem(x, ids, scores, w13, w2, gy)


def reference(x_TD, ids_TK, scores_TK, w13_GFD, w2_GDF):
    """float64 y_TD with every global expert's weights (differentiable in all float inputs)."""
    F = w2_GDF.shape[2]
    x = x_TD.double()
    y = torch.zeros_like(x)
    for k in range(ids_TK.shape[1]):
        e = ids_TK[:, k].long()
        active = (e >= 0).double().unsqueeze(1)
        e = e.clamp(min=0)
        h13 = torch.einsum("td,tfd->tf", x, w13_GFD.double()[e])
        h = torch.nn.functional.silu(h13[:, :F]) * h13[:, F:]
        y = y + active * scores_TK[:, k:k + 1].double() * torch.einsum("tf,tdf->td", h, w2_GDF.double()[e])
    return y


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))
