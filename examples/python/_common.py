"""Shared setup of the examples: the process group (gloo on CPU, nccl on GPU) and the device."""

import argparse
import os

import torch
import torch.distributed as dist


def parse(description: str, **extra) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="cuda when a GPU is present (auto), else cpu")
    for name, (kind, default, help_) in extra.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=help_)
    return ap.parse_args()


def setup(device_arg: str):
    """Returns (group or None, rank, world size, device). Under torchrun every process is one EP
    rank; without torchrun the example runs as a single rank."""
    cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        group, rank, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    else:
        group, rank, size = None, 0, 1
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return group, rank, size, device


def teardown(group) -> None:
    if group is not None:
        dist.destroy_process_group()
