"""Counting, on the CPU, what would make the CPU wait for the GPU.

On CUDA the CPU queues kernels and runs ahead; it stops and waits for the GPU to finish everything
queued when it reads a tensor back (``.tolist()``, ``.item()``, ``float(t)``, ``int(t)``, ``if t:``,
``.cpu()``) and when it copies ordinary (pageable) memory to the device: ``torch.tensor(a_list,
device="cuda")``, ``t.to("cuda")`` without ``non_blocking``, and indexing a device tensor with a Python
list (which makes the list a tensor and copies it over first); and a result whose shape depends on the data
(``t[mask]`` with a boolean mask, ``nonzero``, ``masked_select``: the host must learn how many elements came out
before it can go on). None of that can be seen on a CPU, where nothing waits; but each is a call that can be
counted. ``count_syncs`` counts them while it is open::

    with count_syncs() as syncs:
        sample(...)
    assert syncs.reads == 1 and not syncs.copies and not syncs.list_indexing and not syncs.data_dependent

It also counts the random draws that fill a tensor in place (``exponential_``, ``uniform_``), a kernel
launch each: what batching the draws saves."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

READS = ("tolist", "item", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
DRAWS = ("exponential_", "uniform_")


@dataclass
class Syncs:
    """What ran while ``count_syncs`` was open, by name."""

    calls: Counter = field(default_factory=Counter)

    @property
    def reads(self) -> int:
        """Host reads of a tensor: each one waits for the GPU."""
        return sum(self.calls[name] for name in READS)

    @property
    def copies(self) -> int:
        """Blocking copies of host data to a device: a Python list made a tensor straight on a device, or
        ``.to(device)`` without ``non_blocking``."""
        return self.calls["torch.tensor(list, device=...)"] + self.calls["blocking .to(device)"]

    @property
    def list_indexing(self) -> int:
        """Tensors indexed with a Python list (read or written)."""
        return self.calls["tensor[list]"]

    @property
    def data_dependent(self) -> int:
        """Results whose shape the device's numbers decide (a boolean mask's selection, ``nonzero``)."""
        return self.calls["tensor[mask]"] + self.calls["nonzero"] + self.calls["masked_select"]

    @property
    def draws(self) -> int:
        """Random fills, one kernel launch each."""
        return sum(self.calls[name] for name in DRAWS)


def holds_a_list(index: Any) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


def is_a_mask(index: Any) -> bool:
    """Whether ``index`` selects with a boolean tensor (alone or in a tuple): its result's shape is the mask's count."""
    indexes = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indexes)


def names_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves the tensor to a device (rather than only changing its dtype)."""
    return "device" in kwargs or any(isinstance(arg, str | torch.device) for arg in args)


@contextlib.contextmanager
def count_syncs() -> Iterator[Syncs]:
    """Count every call that would make the CPU wait for the GPU (see the module's docstring) while open."""
    syncs = Syncs()

    def counting(name: str, original: Any, counts: Any = lambda *args, **kwargs: True) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if counts(*args, **kwargs):
                syncs.calls[name] += 1
            return original(*args, **kwargs)
        return wrapper

    tensor_methods = {name: counting(name, getattr(torch.Tensor, name))
                      for name in READS + DRAWS + ("nonzero", "masked_select")}
    tensor_methods["__getitem__"] = counting("tensor[mask]", counting("tensor[list]", torch.Tensor.__getitem__,
                                                                      lambda self, index: holds_a_list(index)),
                                             lambda self, index: is_a_mask(index))
    tensor_methods["__setitem__"] = counting("tensor[list]", torch.Tensor.__setitem__,
                                             lambda self, index, value: holds_a_list(index))
    tensor_methods["to"] = counting("blocking .to(device)", torch.Tensor.to,
                                    lambda self, *args, **kwargs: names_a_device(args, kwargs)
                                    and not kwargs.get("non_blocking", False))
    new_tensor = counting("torch.tensor(list, device=...)", torch.tensor,
                          lambda data, *args, **kwargs: isinstance(data, list | tuple)
                          and kwargs.get("device") is not None)
    with contextlib.ExitStack() as stack:
        for name, wrapper in tensor_methods.items():
            stack.enter_context(mock.patch.object(torch.Tensor, name, wrapper))
        stack.enter_context(mock.patch.object(torch, "tensor", new_tensor))
        for name in ("nonzero", "masked_select"):
            stack.enter_context(mock.patch.object(torch, name, counting(name, getattr(torch, name))))
        yield syncs
