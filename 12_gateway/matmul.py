"""A linear layer, ``x @ W^T + b``, in the order this CPU's matrix library computes fastest.

A decode step multiplies every weight matrix by a handful of rows: one row at batch 1, a few at low
concurrency. On a GPU ``F.linear`` handles that well, and it is all this module does there. On a CPU,
PyTorch hands a single row to MKL's matrix-*vector* routine, which runs on one core and reads the
weights at about a third of the memory's speed; a few rows (2 to 7) take a path no better. Written the
other way round, ``(W @ X^T)^T`` with at least two columns, the same dot products become a matrix
product that MKL spreads over the cores. Measured on the course's 2-core CPU, all the matrix products of
one SmolLM2-135M step (float32, every weight read once)::

    rows in the step       1        2        4       8       16
    F.linear            44.7 ms  78.1 ms  62.7 ms  56.0 ms  68.5 ms
    (W @ X^T)^T         18.9 ms  18.9 ms  25.4 ms  42.5 ms  60.9 ms   (one row: doubled into two columns)

From about a dozen rows on the two are alike, and ``F.linear`` stays. Each output is still the same dot
product of a weight row and an input row, but the library may add its terms in another order, so the
last bits can differ from ``F.linear``'s: as they already do between batch sizes (the tests compare with
Hugging Face under the course's near-tie rule).

bfloat16 on a CPU without bfloat16 instructions (this one: AVX2, no AVX512-BF16, AVX512-BW or AMX, so
oneDNN's bfloat16 kernels are not used) goes through PyTorch's generic kernel, which is fine for a row or
two (reading half the bytes of float32 pays: the output projection of one row, 3.1 ms against 8.0) and
several times slower from a dozen rows on, where the arithmetic counts: the output projection
([49152, 576]) of 64 rows takes 185 ms, against 48 ms in float32. From ``UPCAST_ROWS`` rows on such a
product is computed in float32, the weights converted a block of ``UPCAST_BLOCK`` rows at a time (small
enough to stay in the cache while the matrix library reads it): 52 ms for those 64 rows. The weights stay
bfloat16 in memory; each product is as exact as float32's, then rounded to bfloat16 as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .quantize import QuantizedWeight

SKINNY_ROWS = 16  # fewer rows than this: the transposed product (measured above)
UPCAST_ROWS = 16  # bfloat16 on a CPU without its instructions: this many rows or more, computed in float32
UPCAST_BLOCK = 4096  # weight rows converted to float32 at a time: 9 MB for the course model's 576 columns
# oneDNN's bfloat16 kernels run on this CPU (a build without oneDNN has none: PyTorch's generic kernel, as here)
NATIVE_BFLOAT16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias``: F.linear, except for a few float32 rows on a CPU, and many bfloat16 rows on a CPU
    without bfloat16 instructions; a weight kept in fewer bytes multiplies with its own kernel (quantize.py)."""
    # x: [T, in]; weight: [out, in]; bias: [out] -> [T, out]
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias)
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    if x.dtype == torch.bfloat16 and rows >= UPCAST_ROWS and not NATIVE_BFLOAT16:
        return upcast_linear(x, weight, bias)
    if x.dtype != torch.float32 or rows >= SKINNY_ROWS:
        return F.linear(x, weight, bias)
    columns = (x if rows > 1 else torch.cat((x, x))).t()  # [in, T]: at least two columns, or MKL takes one core
    out = torch.mm(weight, columns)[:, :rows].t()  # [out, T] -> [T, out], a transposed view
    return out + bias if bias is not None else out.contiguous()


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of 16-bit tensors computed in float32, the weight converted a block of rows at a time."""
    # x: [T, in]; weight: [out, in] -> [T, out] in x's dtype
    x32 = x.float()
    out = torch.cat([F.linear(x32, block.float()) for block in weight.split(UPCAST_BLOCK)], dim=1)  # [T, out]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, the same checkpoint names) computed by ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
