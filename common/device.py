"""Which device and number format a stage runs on: one rule for every stage."""

from __future__ import annotations

import torch


class DeviceUnavailable(RuntimeError):
    """``--device cuda`` was asked for on a machine where CUDA cannot be used."""


def pick_device(device: str) -> torch.device:
    """``auto`` takes CUDA when it is usable and quietly falls back to the CPU; ``cuda`` insists."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build of PyTorch" if torch.version.cuda is None else "no usable CUDA device or driver"
        raise DeviceUnavailable(f"--device cuda: CUDA is not usable here ({build}); use --device cpu or auto")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """float32 on CPU (exact, and fast enough for a 135M model); bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)
