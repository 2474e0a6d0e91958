"""Which device and number format a stage runs on: one rule for every stage."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


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


def keep_freed_memory() -> None:
    """Let the C allocator keep large freed blocks for reuse, instead of handing them back to the OS.

    glibc's malloc serves any allocation over 32 MiB with a fresh ``mmap`` and returns it to the OS
    when it is freed, so the next one starts from untouched pages and pays a page fault for every
    4 KiB of it. On a CPU the reference attention of a batched decode step gathers every sequence's
    keys and values into new tensors (64 sequences of 1,000 tokens: 50 MB per layer, twice); profiled,
    each such ``index_select`` took 14.8 ms into fresh pages and 2.5 ms into reused ones, and the decode
    step 1.6 s against 0.64 s. With a higher mmap threshold the memory stays in the process and is
    reused from one step to the next. Production CPU inference gets the same effect by preloading
    tcmalloc or jemalloc. No effect off glibc (macOS, musl).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt's parameter numbers, from <malloc.h>
    libc.mallopt(m_mmap_threshold, 1 << 30)  # up to 1 GiB: from the heap, kept when freed
    libc.mallopt(m_trim_threshold, 2 << 30)  # return the heap's free top to the OS only past 2 GiB


def build_off_the_main_thread(make: Callable[[], T]) -> T:
    """``make()`` (an engine: weights loaded, kernels warmed up) on a thread that ends when it returns.

    On a CPU, PyTorch's operators split their work over OpenMP threads, and OpenMP gives every thread that starts
    such work a pool of worker threads of its own. A server builds its engine and then steps it on the engine
    thread: built on the main thread, the engine would leave a pool there too, and the process would hold more
    OpenMP threads than the machine has cores. GNU OpenMP then lets its idle workers spin only briefly before they
    sleep, so each of a step's hundreds of small operations waits for a worker to wake: on 2 cores a decode step of
    the course model took 65 ms on the engine thread against 41 ms on the thread that built it. A thread's pool ends
    with the thread, so the engine thread's pool is the only one. (On a GPU this changes nothing.)"""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="build") as builder:
        return builder.submit(make).result()  # raises what make() raised
