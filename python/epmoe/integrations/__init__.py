"""Integrations with transformers and TorchTitan, importable without either package installed.

transformers: an expert-parallel strategy (experts style + router pass-through style + an `auto`
rule) written against transformers' style-class protocol (shard_param / validate_param /
install_forward); `register_with_transformers()` adds it to transformers' registries when
transformers is importable.

torchtitan: a routed-experts module with TorchTitan's forward signature and weight names, a
ParallelStyle that shards it over an EP group, a rank-wide runtime owning the one context, and a
token dispatcher with TorchTitan's dispatch/combine protocol (the layered ops).

docs/python.md describes the protocols and what differs from the real frameworks.
"""

from . import torchtitan, transformers

__all__ = ["torchtitan", "transformers"]
