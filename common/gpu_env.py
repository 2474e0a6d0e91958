"""Where a GPU's results go, and what every record of one says about the machine and the code.

Two GPUs give two sets of numbers: each goes to ``results/cuda/<its name>/`` (``nvidia-h200``,
``nvidia-h100-80gb-hbm3``), so that a run on one never overwrites another's. Every record written there
carries ``environment()``: the GPU's name, the torch, triton and transformers versions, and the commit.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"


def gpu_slug(name: str) -> str:
    """A GPU's name as a folder: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def gpu_name() -> str | None:
    """This machine's first GPU's name, or None where CUDA is not usable."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def results_dir(device: str, gpu: str | None = None) -> Path:
    """``results/cuda/<gpu slug>/`` on a GPU (``gpu``: its name, default this machine's), ``results/<device>/``
    elsewhere."""
    if device != "cuda":
        return RESULTS / device
    return RESULTS / "cuda" / gpu_slug(gpu or gpu_name() or "gpu")


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    """What a record needs to be compared with another: the GPU (None off CUDA), the versions of what computes,
    and the commit (with whether the tree had changes on top of it)."""
    import torch

    from .bench import git_state

    return {"gpu": gpu_name() if device == "cuda" else None, "torch": torch.__version__,
            "triton": version("triton"), "transformers": version("transformers"),
            "cuda": torch.version.cuda, **git_state()}
