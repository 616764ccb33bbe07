"""Tiny MoE layers in the shapes transformers and TorchTitan use, with reproducible weights."""

import torch
from torch import nn

from epmoe.integrations import _common
from epmoe.integrations.torchtitan import EpmoeRoutedExperts

T, D, F, K, EXPERTS, R = 20, 32, 16, 2, 4, 2


class HFExperts(nn.Module):
    """transformers' experts contract: gate_up_proj [E, 2F, D], down_proj [E, D, F]."""

    def __init__(self, g):
        super().__init__()
        self.num_experts = EXPERTS
        self.gate_up_proj = nn.Parameter((torch.randn(EXPERTS, 2 * F, D, generator=g) / D ** 0.5).bfloat16())
        self.down_proj = nn.Parameter((torch.randn(EXPERTS, D, F, generator=g) / F ** 0.5).bfloat16())

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _common.eager_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


class HFSparseMoeBlock(nn.Module):
    """Router (fp32 softmax, normalised top-k) + experts, as Qwen3-MoE's block."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate = nn.Linear(D, EXPERTS, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(EXPERTS, D, generator=g) / D ** 0.5)
        self.experts = HFExperts(g)

    def forward(self, hidden_states):
        logits = self.gate(hidden_states.float())
        probs = torch.softmax(logits, dim=-1)
        w, idx = torch.topk(probs, K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return self.experts(hidden_states, idx, w)


def titan_module(seed=0):
    m = EpmoeRoutedExperts(EpmoeRoutedExperts.Config(num_experts=EXPERTS, hidden_dim=D, intermediate_dim=F, top_k=K))
    m.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    return m


def batch(seed=1):
    """Per-rank tokens, routes and output grads: x [R, T, D] bf16, ids [R, T, K], scores, grad_y."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, T, D, generator=g) * 0.5).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(R * T)]).view(R, T, K)
    scores = torch.rand(R, T, K, generator=g) + 0.1
    gy = torch.randn(R, T, D, generator=g).bfloat16()
    return x, ids, scores, gy
