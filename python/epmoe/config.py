"""Config: the static description of one EP group's MoE layers (mirrors Dist-MoE's Config).

Frozen and validated at construction: every error is a ValueError/TypeError naming the field with
the expected and the actual value. The C++ side (epmoe::Config) validates again at
create_context/plan_memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

_ACTIVATIONS = ("swiglu", "swiglu_clamped")
_PRECISIONS = ("bf16", "fp8_block")  # nvfp4 inference needs prepared weights, not exposed yet
_COMBINES = ("per_route", "per_rank")
_FP8_WGRADS = ("fp8", "bf16", "by_shape")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Config.{name}: expected an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"Config.{name}: expected > 0, got {value}")


def _finite_positive(name: str, value, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Config.{name}: expected a number, got {type(value).__name__} {value!r}")
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"Config.{name}: expected a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclasses.dataclass(frozen=True)
class Config:
    """One context's static shape and policies. T, D, F, K and the global expert count are required.

    Differences from Dist-MoE's Config are listed in docs/python.md.
    """

    max_num_local_input_tokens: int  # T: physical rows per call and rank (a call may pass fewer)
    hidden_dim: int  # D
    intermediate_dim: int  # F
    top_k: int  # K
    num_experts: int  # global experts E*R; rank r owns [r*E, (r+1)*E)
    max_moe_layers_per_activation_slot: int = 1  # L: layers whose forward may await backward
    device_scratch_capacity_factor: float = 1.0  # receive rows = factor * T*K, clamped to R*T*min(K,E)
    activation_slot_bytes: Optional[int] = None
    activation_slot_capacity_factor: Optional[float] = None
    num_activation_slots: int = 1
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    wgrad_dtype: Optional[torch.dtype] = None  # None/bfloat16 or float32
    inference: bool = False
    # epmoe extensions
    overflow: str = "report"  # "report": status word + error on check(); "trap"
    check_inputs: bool = True  # device-side checks of ids range and finite x / scores
    barrier_timeout_ms: int = 30000
    fuse_epilogues: bool = True
    # "bf16", or "fp8_block": FP8 block-scaled training (E4M3, 1x128 activation / 128x128 weight
    # scales; the weights are quantized from the bf16 ones on every call). Training on the CPU
    # backend only so far; inference (inference=True, the forward) on CPU and CUDA.
    precision: str = "bf16"
    arrival_gated_w13: bool = False  # CUDA: W13 overlaps dispatch, gated by row arrival counters
    # Most scratch bytes in device memory; the rest is pinned host memory in the same range. None: all device.
    scratch_device_bytes: Optional[int] = None
    # "per_route": one combine row per route crosses back to the token's rank; "per_rank": one row
    # per (token, rank holding its routes), summed on the expert side (bf16 only).
    combine: str = "per_route"
    # precision "fp8_block" (training): "fp8", both weight gradients as FP8 WGRADs on 128x1
    # column-quantized operands; "bf16", as bf16 WGRADs on the bf16 operands (x decoded from its
    # E4M3 rows); "by_shape" (the default), the planner picks one from the shape: "fp8" iff the
    # balanced rows per local expert T*K*R/E >= 512 and D*F/(D+F) >= 1024 (plan_memory(...)
    # .fp8_wgrad is the choice, .fp8_wgrad_reason why). Other precisions: "by_shape"
    # (docs/formats.md "The weight gradients in bf16").
    fp8_wgrad: str = "by_shape"

    def __post_init__(self) -> None:
        for name in ("max_num_local_input_tokens", "hidden_dim", "intermediate_dim", "top_k",
                     "num_experts", "max_moe_layers_per_activation_slot", "barrier_timeout_ms"):
            _positive_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"Config.top_k: expected <= num_experts ({self.num_experts}), got {self.top_k}")
        _finite_positive("device_scratch_capacity_factor", self.device_scratch_capacity_factor)
        if self.activation_slot_bytes is not None and self.activation_slot_capacity_factor is not None:
            raise ValueError("Config.activation_slot_bytes: expected None when "
                             "activation_slot_capacity_factor is set, got both")
        if self.activation_slot_bytes is not None:
            v = self.activation_slot_bytes
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"Config.activation_slot_bytes: expected an int >= 0, got {v!r}")
        if self.activation_slot_capacity_factor is not None:
            _finite_positive("activation_slot_capacity_factor", self.activation_slot_capacity_factor, True)
        n = self.num_activation_slots
        if isinstance(n, bool) or not isinstance(n, int) or n < (0 if self.inference else 1):
            raise ValueError(f"Config.num_activation_slots: expected an int >= {0 if self.inference else 1}, got {n!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"Config.activation: expected one of {_ACTIVATIONS}, got {self.activation!r}")
        if self.activation == "swiglu_clamped":
            _finite_positive("swiglu_alpha", self.swiglu_alpha)
            _finite_positive("swiglu_limit", self.swiglu_limit)
        if self.wgrad_dtype not in (None, torch.bfloat16, torch.float32):
            raise TypeError(f"Config.wgrad_dtype: expected None, torch.bfloat16 or torch.float32, got {self.wgrad_dtype!r}")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"Config.precision: expected one of {_PRECISIONS}, got {self.precision!r}")
        if self.combine not in _COMBINES:
            raise ValueError(f"Config.combine: expected one of {_COMBINES}, got {self.combine!r}")
        if self.fp8_wgrad not in _FP8_WGRADS:
            raise ValueError(f"Config.fp8_wgrad: expected one of {_FP8_WGRADS}, got {self.fp8_wgrad!r}")
        if self.fp8_wgrad != "by_shape" and self.precision != "fp8_block":
            raise ValueError(f"Config.fp8_wgrad: expected 'by_shape' (the default) with precision "
                             f"{self.precision!r}, got {self.fp8_wgrad!r}")
        if self.overflow not in ("report", "trap"):
            raise ValueError(f"Config.overflow: expected 'report' or 'trap', got {self.overflow!r}")
        for name in ("inference", "check_inputs", "fuse_epilogues", "arrival_gated_w13"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.scratch_device_bytes is not None:
            v = self.scratch_device_bytes
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Config.scratch_device_bytes: expected None or an int >= 0, got {v!r}")

    def local_experts(self, ep_size: int) -> int:
        if self.num_experts % ep_size != 0:
            raise ValueError(f"Config.num_experts: expected a multiple of ep_size {ep_size}, got {self.num_experts}")
        return self.num_experts // ep_size

    def to_native(self) -> str:
        """The "key=value;..." form the C++ binding parses (src/torch/registry.cpp)."""
        fields = {
            "max_tokens_per_rank": self.max_num_local_input_tokens,
            "hidden_dim": self.hidden_dim,
            "intermediate_dim": self.intermediate_dim,
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "activation": self.activation,
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "capacity_factor": self.device_scratch_capacity_factor,
            "num_activation_slots": 0 if self.inference else self.num_activation_slots,
            "max_layers_per_slot": self.max_moe_layers_per_activation_slot,
            "wgrad_dtype": "f32" if self.wgrad_dtype == torch.float32 else "bf16",
            "inference": int(self.inference),
            "overflow": self.overflow,
            "precision": self.precision,
            "check_inputs": int(self.check_inputs),
            "barrier_timeout_ms": self.barrier_timeout_ms,
            "fuse_epilogues": int(self.fuse_epilogues),
            "arrival_gated_w13": int(self.arrival_gated_w13),
            "combine": self.combine,
            "fp8_wgrad": self.fp8_wgrad,
        }
        if self.activation_slot_bytes is not None:
            fields["activation_slot_bytes"] = self.activation_slot_bytes
        if self.activation_slot_capacity_factor is not None:
            fields["activation_slot_capacity_factor"] = self.activation_slot_capacity_factor
        if self.scratch_device_bytes is not None:
            fields["scratch_device_bytes"] = self.scratch_device_bytes
        return ";".join(f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
