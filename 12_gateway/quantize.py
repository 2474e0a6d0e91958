"""Weight-only quantization: every linear layer's weight kept, read and multiplied in 4 or 8 bits.

A decode step at a few rows does almost no arithmetic per weight: each weight is read once, multiplied by one
number per row, and never used again in that step. On a CPU such a step is bound by how fast the weights come
out of memory, and float32 weights take 4 bytes each. Kept in 4 bits (with a scale per group) they take about
an eighth; the kernel reads the small codes and widens each group in registers. That is the whole idea: fewer
bytes per weight read, the same dot products.

Two formats, both torch's own kernels (``torch.ops.aten``):

- **int4, groups of 32** (``Int4Weight``): a 4-bit code ``q`` per weight and, per group of 32 along a row, a scale
  ``s`` and a zero ``z``: weight = (q - 8) * s + z. The course model's GGUF already holds its linear layers this
  way: Q4_1 blocks of 32 (weight = d * q + m), which are the same numbers with s = d and z = m + 8 d. So the int4
  engine computes with the file's own blocks, not a second quantization of them (``common.gguf_blocks`` reads
  them). A checkpoint without a GGUF is put in blocks at load, Q4_1's way: each group's minimum and 15 steps to
  its maximum.
- **int8, per output channel** (``Int8Weight``): a signed byte per weight and one scale per row, the largest
  weight of the row mapping to 127. Any float checkpoint (a local Llama, Qwen2 or Mistral folder) is quantized
  this way at load. The embedding, which the course model ties to its output projection, is kept this way in
  both modes: its rows are looked up one token at a time, and the output projection reads all of it.

Both kernels take bfloat16 activations (the float32 path of the CPU kernels is a scalar loop, several times
slower than float32 itself), and on a CPU they want the scales in bfloat16 too. So each layer rounds its input
to bfloat16 and its output back, and the weights it multiplies are the blocks with their scales rounded to
bfloat16: ``dequantize()`` gives exactly those numbers in float32, which is what the tests give Hugging Face
(the fake-quantized reference): only the order of sums and the activations' rounding differ.

Which product a step takes depends on its rows (``Int8Weight.KERNEL_ROWS``): the int8 kernel is the faster one
for a few rows and the slower one for many (it is written for the memory-bound case), where the weights are
widened to float32 a block of rows at a time and multiplied by the matrix library; the int4 kernel stayed within
a few percent of float32 up to the largest step (numbers in the lesson, from ``quant_bench``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common.gguf_blocks import BLOCK, Blocks
from common.weights import source_gguf

if TYPE_CHECKING:
    from .parallel import Shard

MODES = ("none", "int8", "int4")
DEQUANTIZE_BLOCK = 4096  # weight rows widened to float32 at a time in the many-rows product: 9 MB at 576 columns


class QuantizedWeight(nn.Module):
    """A weight matrix [out, in] kept in fewer bytes, standing in for a float weight: its layer calls
    ``linear(x, bias)`` where it called ``F.linear(x, weight, bias)``."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = torch.Size(shape)  # [out, in], the float weight's
        self.dtype = dtype  # the float dtype it stands for: what its products return

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the kernel multiplies by."""
        raise NotImplementedError

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class Int4Weight(QuantizedWeight):
    """int4 codes in groups of 32 along each row, a bfloat16 scale and zero per group: (q - 8) * s + z."""

    def __init__(self, blocks: Blocks, dtype: torch.dtype) -> None:
        super().__init__(tuple(blocks.codes.shape), dtype)
        assert blocks.kind == "Q4_1", blocks.kind
        # The kernels' scale s and zero z of each block, such that (q - 8) * s + z is the block's d * q + m.
        ### BEGIN SOLUTION 11.2
        scale, zero = blocks.scale, blocks.minimum + 8 * blocks.scale  # d * q + m = (q - 8) * d + (m + 8 d)
        ### END SOLUTION
        # scale_and_zero: [G, out, 2], as both of torch's int4 kernels take it
        self.register_buffer("scale_and_zero", torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16))
        codes = blocks.codes.to(torch.int32)  # [out, in], 0..15
        if codes.device.type == "cuda":  # tinygemm's tiles: two codes a byte, then its own layout
            inner_k_tiles = next(n for n in (8, 4, 2) if codes.shape[1] % (16 * n) == 0)
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # [out, in / 2]
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles))
        else:  # [out, in / 2] bytes in the CPU kernel's own order
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))

    def _kernel(self, x: torch.Tensor, scale_and_zero: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, BLOCK, scale_and_zero)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, BLOCK, scale_and_zero)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out] in x's dtype, through bfloat16
        out = self._kernel(x.to(torch.bfloat16), self.scale_and_zero).to(x.dtype)
        return out + bias if bias is not None else out

    def dequantize(self) -> torch.Tensor:
        """The kernel's own weights, read back through it: identity @ W^T = W^T. On a CPU, in float32 (the
        kernel's exact path for float32 input, scales widened exactly from bfloat16)."""
        eye = torch.eye(self.shape[1], device=self.packed.device)  # [in, in]
        if eye.device.type == "cuda":  # the CUDA kernel takes bfloat16 only: exact for the codes, rounded once
            return self._kernel(eye.to(torch.bfloat16), self.scale_and_zero).float().t().contiguous()
        return self._kernel(eye, self.scale_and_zero.float()).t().contiguous()  # [out, in]


class Int8Weight(QuantizedWeight):
    """int8 codes, one bfloat16 scale per output row: weight = s * q."""

    KERNEL_ROWS = 256  # from this many rows on (CPU), the widened product: the int8 kernel was the slower one there

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__(tuple(codes.shape), dtype)
        self.register_buffer("codes", codes)  # [out, in] int8
        self.register_buffer("scale", scale.to(torch.bfloat16))  # [out]

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric per-row quantization: the scale rounded to bfloat16 first, so that the codes are the nearest
        ones for the scale the kernel will use."""
        w = weight.float()  # [out, in]
        ### BEGIN SOLUTION 11.1
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16).float()  # [out]
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        ### END SOLUTION
        return cls(codes, scale, weight.dtype)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether the product of ``x`` ([T, in]) takes the int8 kernel: on a CPU, for fewer than KERNEL_ROWS rows.
        Else the weights are widened and multiplied in float (on CUDA always: no int8 kernel is used there)."""
        ### BEGIN SOLUTION 11.4
        return x.device.type == "cpu" and x.shape[0] < self.KERNEL_ROWS
        ### END SOLUTION

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out] in x's dtype
        if self.uses_kernel(x):
            out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scale).to(x.dtype)
        else:  # widened a block of rows at a time, multiplied in x's dtype (on CUDA: every step, see the lesson)
            out = torch.cat([F.linear(x, (codes.to(x.dtype) * scale.to(x.dtype)[:, None]))
                             for codes, scale in zip(self.codes.split(DEQUANTIZE_BLOCK),
                                                     self.scale.split(DEQUANTIZE_BLOCK), strict=True)], dim=1)
        return out + bias if bias is not None else out

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float()[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """An embedding lookup: the float rows of ``ids``, [T] -> [T, in]."""
        return self.codes[ids].to(self.dtype) * self.scale[ids].to(self.dtype)[:, None]


def pick_quantization(mode: str, model_dir: Path) -> str:
    """``--quantization``, "auto" resolved: int4 for a model that ships in 4-bit blocks (a GGUF: the course's), none
    for a float checkpoint (quantizing it changes its numbers: asked for, not done by default)."""
    if mode not in ("auto", *MODES):
        raise ValueError(f"--quantization {mode!r}: one of auto, {', '.join(MODES)}")
    if mode == "auto":
        return "int4" if source_gguf(model_dir) is not None else "none"
    return mode


def embedding(ids: torch.Tensor, weight: torch.Tensor | Int8Weight) -> torch.Tensor:
    """``F.embedding``, of a float weight or of one kept in int8: [T] -> [T, hidden]."""
    return weight.rows(ids) if isinstance(weight, Int8Weight) else F.embedding(ids, weight)


# --- putting a loaded model's weights in blocks ----------------------------------------------------------


def q4_1_blocks(weight: torch.Tensor) -> Blocks:
    """A float weight in Q4_1 blocks of 32 (for a checkpoint without a GGUF): per group, its minimum m and 15 even
    steps d to its maximum; each weight the nearest step. (The course model's blocks come from its file instead.)"""
    out, cols = weight.shape
    groups = weight.float().reshape(out, cols // BLOCK, BLOCK)  # [out, G, 32]
    ### BEGIN SOLUTION 11.3
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, G]
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    ### END SOLUTION
    return Blocks(codes.reshape(out, cols), scale, low, "Q4_1")


def shard_blocks(blocks: Blocks, shard: Shard | None) -> Blocks:
    """This rank's part of a checkpoint tensor's blocks: rows as they are; columns a whole number of groups."""
    if shard is None:
        return blocks
    if shard.dim == 0:
        rows = shard.index()
        return Blocks(blocks.codes[rows], blocks.scale[rows], blocks.minimum[rows], blocks.kind)
    assert shard.start % BLOCK == 0 and shard.stop % BLOCK == 0, f"{shard} cuts a block of {BLOCK}"
    groups = slice(shard.start // BLOCK, shard.stop // BLOCK)
    return Blocks(blocks.codes[:, shard.start:shard.stop], blocks.scale[:, groups], blocks.minimum[:, groups],
                  blocks.kind)


def stack_blocks(parts: list[Blocks]) -> Blocks:
    """The blocks of a stacked layer ([q; k; v], [gate; up]) from its checkpoint tensors', in order."""
    if len(parts) == 1:
        return parts[0]
    return Blocks(*(torch.cat([getattr(b, name) for b in parts]) for name in ("codes", "scale", "minimum")), "Q4_1")
