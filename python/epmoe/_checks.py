"""Host-side checks at the Python boundary, before any kernel runs. Wrong dtype -> TypeError;
wrong shape, device, contiguity or value -> ValueError; each names the argument and gives the
expected and the actual value. Value checks (ids in range, finite scores and x) read the data, so
they run only on real tensors outside tracing, by default on CPU tensors only (on CUDA they would
synchronise; the device status word reports the same errors through Context.check())."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def tensor(name: str, t, dtypes: tuple, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {list(t.stride())}")


def rows(name: str, t, limit: int) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected 2 dimensions [T, D], got shape {list(t.shape)}")
    n = t.shape[0]
    if not 1 <= n <= limit:
        raise ValueError(f"{name}: expected 1 to {limit} rows (Config.max_num_local_input_tokens), got {n}")
    return n


def values_checkable(*ts) -> bool:
    """Real tensors, not under torch.compile / make_fx / FakeTensorMode."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter) for t in ts if t is not None)


def values(ids_TK: torch.Tensor, scores_TK: torch.Tensor, x_TD, num_experts: int, num_tokens_1) -> None:
    live = ids_TK.shape[0] if num_tokens_1 is None else int(num_tokens_1.item())
    if not 0 <= live <= ids_TK.shape[0]:
        raise ValueError(f"num_tokens_1: expected a live count in [0, {ids_TK.shape[0]}], got {live}")
    ids = ids_TK[:live]
    bad = (ids < -1) | (ids >= num_experts)
    if bool(bad.any()):
        t, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"topk_ids_TK: expected ids in [-1, {num_experts}), got {int(ids[t, k])} at [{t}, {k}]")
    scores = scores_TK[:live]
    nonfinite = ~torch.isfinite(scores) & (ids >= 0)
    if bool(nonfinite.any()):
        t, k = (int(v) for v in nonfinite.nonzero()[0])
        raise ValueError(f"topk_scores_TK: expected finite scores on active routes, got {float(scores[t, k])} at [{t}, {k}]")
    if x_TD is not None and not bool(torch.isfinite(x_TD[:live]).all()):
        t = int((~torch.isfinite(x_TD[:live])).any(dim=1).nonzero()[0])
        raise ValueError(f"x_TD: expected finite values, got a NaN/Inf in row {t}")
