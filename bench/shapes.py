"""The benchmark shapes and routings of MEASURE.md."""
import torch

# name: (D, F, E global, K, T train, T decode)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 8192, 128),
    "deepseek-v3": (7168, 2048, 256, 8, 4096, 128),
    "gpt-oss-120b": (2880, 2880, 128, 4, 8192, 128),
    "mixtral-8x7b": (4096, 14336, 8, 2, 8192, 128),
    "ci-tiny": (128, 96, 8, 2, 64, 8),
}


def route(routing: str, T: int, E: int, K: int, ep: int = 1, generator=None, device="cuda"):
    """Top-k ids (int32 [T, K]) and scores (f32 [T, K]) for a MEASURE.md routing."""
    g = generator
    if routing == "balanced":
        logits = torch.rand(T, E, device=device, generator=g)
    elif routing == "skew":
        logits = torch.rand(T, E, device=device, generator=g) + 4.0 * torch.linspace(
            1.0, 0.0, E, device=device)
    elif routing == "one-expert":
        ids = torch.zeros(T, K, dtype=torch.int32, device=device)
        ids[:, 1:] = -1
        scores = torch.rand(T, K, device=device, generator=g)
        return ids, scores
    elif routing == "empty-rank":
        logits = torch.rand(T, E, device=device, generator=g)
        logits[:, E - E // ep:] = -1.0  # the last rank's experts are never chosen
    else:
        raise ValueError(f"routing: expected balanced, skew, one-expert or empty-rank, got {routing}")
    top, ids = logits.topk(K, dim=1)
    scores = torch.softmax(top, dim=1)
    return ids.to(torch.int32), scores.float()


def useful_routes(ids):
    return int((ids >= 0).sum().item())
