"""One BF16 training step of a tiny MoE block (router in the model, routed experts in epmoe).

    torchrun --nproc-per-node 2 examples/python/train_step.py           # two CPU ranks
    torchrun --nproc-per-node 1 examples/python/train_step.py --device cuda

Each rank holds its own tokens and its own experts (rank r: experts [r*E, (r+1)*E)); the router
is replicated and its gradient is all-reduced like any data-parallel parameter.
"""

import torch
import torch.distributed as dist

import epmoe
from _common import parse, setup, teardown


class MoEBlock(torch.nn.Module):
    def __init__(self, context: epmoe.Context, num_experts: int, hidden: int, inter: int, top_k: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        E = num_experts // context.ep_size
        r = context.rank
        self.context, self.top_k = context, top_k
        self.router = torch.nn.Linear(hidden, num_experts, bias=False)
        torch.nn.init.normal_(self.router.weight, std=hidden ** -0.5, generator=g)
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
        w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
        self.w13 = torch.nn.Parameter(w13[r * E:(r + 1) * E].bfloat16())  # this rank's experts
        self.w2 = torch.nn.Parameter(w2[r * E:(r + 1) * E].bfloat16())

    def forward(self, x_TD):
        probs = torch.softmax(self.router(x_TD.float()), dim=-1)
        scores_TK, ids_TK = torch.topk(probs, self.top_k, dim=-1)
        scores_TK = scores_TK / scores_TK.sum(-1, keepdim=True)
        return x_TD + epmoe.routed_experts(x_TD, ids_TK, scores_TK, self.w13, self.w2, self.context)


def main():
    args = parse(__doc__, tokens=(int, 64, "tokens per rank"), steps=(int, 2, "training steps"))
    group, rank, size, device = setup(args.device)
    D, F, K, experts = 128, 64, 2, 4 * size
    config = epmoe.Config(max_num_local_input_tokens=args.tokens, hidden_dim=D, intermediate_dim=F,
                          top_k=K, num_experts=experts, device_scratch_capacity_factor=2.0)
    context = epmoe.create_context(group, config, device)
    block = MoEBlock(context, experts, D, F, K, seed=0).to(device)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.tokens, D, generator=g).bfloat16().to(device)
    target = torch.randn(args.tokens, D, generator=g).bfloat16().to(device)
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(block(x).float(), target.float())
        loss.backward()
        if group is not None:  # replicated router: average its gradient over the ranks
            dist.all_reduce(block.router.weight.grad, group=group)
            block.router.weight.grad /= size
        opt.step()
        context.check()  # raises a device-side error (capacity overflow, bad ids) if one occurred
        print(f"rank {rank}/{size} step {step}: loss {loss.item():.5f}", flush=True)
        assert torch.isfinite(loss)
    context.close()
    teardown(group)


if __name__ == "__main__":
    main()
