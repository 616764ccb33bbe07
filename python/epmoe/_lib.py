"""Loads libepmoe_torch (the TORCH_LIBRARY(epmoe) ops) once, on first import of the package.

Looks in EPMOE_TORCH_LIBRARY (a path; for running from a build tree), then next to this file in
lib/ (where `pip install .` puts it). Importing does not touch CUDA or torch.distributed.
"""

from __future__ import annotations

import glob
import os

import torch

_LOADED: str | None = None


def library_path() -> str:
    explicit = os.environ.get("EPMOE_TORCH_LIBRARY")
    if explicit:
        return explicit
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "lib*", "libepmoe_torch*.so*")))
    if not found:
        raise ImportError(
            f"epmoe: libepmoe_torch.so not found under {here}/lib; build the package with "
            "`pip install --no-build-isolation .` or set EPMOE_TORCH_LIBRARY to a built copy"
        )
    return found[0]


def load() -> None:
    global _LOADED
    if _LOADED is None:
        path = library_path()
        torch.ops.load_library(path)
        _LOADED = path


load()
ops = torch.ops.epmoe
