"""plan_memory: the pure byte plan of one context (no device, no communication)."""

from __future__ import annotations

import dataclasses

from ._lib import ops
from .config import Config


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Every field of epmoe::MemoryPlan (include/epmoe/memory_plan.h) as an attribute and in fields;
    explain() prints every term."""

    fields: dict
    _explain: str

    def __getattr__(self, name: str):
        fields = object.__getattribute__(self, "fields")
        if name in fields:
            return fields[name]
        raise AttributeError(name)

    @property
    def recv_capacity_rows(self) -> int:
        return self.fields["recv_capacity_rows"]

    @property
    def total_bytes(self) -> int:
        return self.fields["total_bytes"]

    def explain(self) -> str:
        return self._explain


def _value(text: str):
    """A field's value: int, float (exact: max_digits10 digits), bool, or a name (slot_sizing)."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def plan_memory(config: Config, ep_size: int, *, device=None) -> MemoryPlan:
    """Pure: what create_context(group of ep_size ranks, config) allocates per rank, to the byte."""
    if not isinstance(config, Config):
        raise TypeError(f"config: expected epmoe.Config, got {type(config).__name__}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: expected an int >= 1, got {ep_size!r}")
    config.local_experts(ep_size)
    native = config.to_native()
    lines = ops._plan_fields(native, ep_size).strip().splitlines()
    fields = {k: _value(v) for k, v in (line.split("=", 1) for line in lines)}
    return MemoryPlan(fields, ops._plan_explain(native, ep_size))


def explain_kernels(config: Config, ep_size: int = 1) -> str:
    """The kernel each grouped GEMM of config at ep_size runs on the CUDA backend, each with the rule
    or environment override that chose it (C++ explain_cuda_kernels; pure host logic, no GPU
    needed). Raises RuntimeError where the library was built without the CUDA backend."""
    if not isinstance(config, Config):
        raise TypeError(f"config: expected epmoe.Config, got {type(config).__name__}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: expected an int >= 1, got {ep_size!r}")
    config.local_experts(ep_size)
    return ops._kernels_explain(config.to_native(), ep_size)
