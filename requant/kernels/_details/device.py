"""Facts about the device a launch runs on. No triton: the interpreter switch and the device's
name (which launch-config file applies, `configs`) are read on any machine."""

from __future__ import annotations

import functools
import os
import re

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1). There bf16 dots
    and arithmetic are wrong, so the kernel computes in FP32."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def chains_launches(index: int) -> bool:
    """Whether CUDA device `index` takes programmatic dependent launch (Hopper and later)."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def config_name(device_name: str) -> str:
    """The file stem of a device's launch configs: its name in lower case, without the vendor, each
    run of other characters one hyphen ("NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" ->
    "h100-80gb-hbm3")."""
    name = re.sub(r"^nvidia\s+", "", device_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def device_config_name(device: torch.device) -> str | None:
    """`config_name` of a CUDA device; None for any other (the CPU, the interpreter)."""
    if device.type != "cuda" or interpreting():
        return None
    return config_name(torch.cuda.get_device_name(device.index or 0))
