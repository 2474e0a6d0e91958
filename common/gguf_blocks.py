"""The quantized blocks of a GGUF file, as they are stored, under the Hugging Face names the stages load.

``weights.py`` dequantizes the course model's GGUF once into a float32 folder, and every stage computes with
those numbers. A quantized stage wants the numbers *before* that step: the file's own blocks, so that it can
compute with exactly the weights every other stage dequantized, in a fraction of the bytes. This module reads
them; what a stage does with them is its lesson.

Two block formats of ggml are read (the ones in the course model: 210 ``Q4_1`` tensors, one ``Q8_0``):

- ``Q4_1``, blocks of 32 weights along a row, 20 bytes each: an fp16 scale ``d``, an fp16 minimum ``m``, then 16
  bytes of 4-bit codes ``q`` (byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high
  one). A weight is ``d * q + m``.
- ``Q8_0``, blocks of 32, 34 bytes each: an fp16 scale ``d`` and 32 signed bytes ``q``. A weight is ``d * q``.

llama.cpp stores the rows of the query and key projections in another order than Hugging Face (it interleaves
the two halves of each head for its rotary embedding); transformers puts them back when it converts, and so do
we: a block lies within one row, so reordering rows moves whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32  # weights per block, in both formats
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes
Q8_0_BYTES = 34  # fp16 d, 32 signed codes

# GGUF tensor name (after "blk.{i}.") -> the Hugging Face parameter of layer i.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class Blocks:
    """One weight matrix [out, in] in blocks of 32 along its rows: weight = scale * codes + minimum."""

    codes: torch.Tensor  # [out, in]: uint8, 0..15 (Q4_1), or int8, -128..127 (Q8_0)
    scale: torch.Tensor  # [out, in // 32] float32 (exact: widened from the file's fp16)
    minimum: torch.Tensor | None  # [out, in // 32] float32 (Q4_1), or None (Q8_0: no offset)
    kind: str  # "Q4_1" or "Q8_0"

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix the blocks stand for: the numbers ``weights.py`` saved for every stage."""
        out, cols = self.codes.shape
        w = self.codes.float().reshape(out, cols // BLOCK, BLOCK) * self.scale[..., None]  # [out, G, 32]
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        return w.reshape(out, cols)

    def to(self, device: torch.device | str) -> Blocks:
        return Blocks(self.codes.to(device), self.scale.to(device),
                      None if self.minimum is None else self.minimum.to(device), self.kind)


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """Two bytes per block ([..., 2] uint8) as the fp16 number they hold, widened to float32."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def q4_1(data: np.ndarray) -> Blocks:
    """A Q4_1 tensor's bytes ([out, in // 32 * 20] uint8) as its blocks."""
    raw = data.reshape(data.shape[0], -1, Q4_1_BYTES)  # [out, G, 20]
    packed = raw[..., 4:]  # [out, G, 16]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [out, G, 32]: weights 0-15, then 16-31
    return Blocks(torch.from_numpy(codes.reshape(data.shape[0], -1)), _fp16(raw[..., 0:2]), _fp16(raw[..., 2:4]),
                  "Q4_1")


def q8_0(data: np.ndarray) -> Blocks:
    """A Q8_0 tensor's bytes ([out, in // 32 * 34] uint8) as its blocks."""
    raw = data.reshape(data.shape[0], -1, Q8_0_BYTES)  # [out, G, 34]
    codes = np.ascontiguousarray(raw[..., 2:]).view(np.int8)  # [out, G, 32]
    return Blocks(torch.from_numpy(codes.reshape(data.shape[0], -1)), _fp16(raw[..., 0:2]), None, "Q8_0")


def unpermute_rows(blocks: Blocks, heads: int) -> Blocks:
    """Hugging Face's row order for a query or key projection of ``heads`` heads (see the module's docstring)."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[0] // heads // 2
        return x.reshape(heads, half, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)

    return Blocks(rows(blocks.codes), rows(blocks.scale),
                  None if blocks.minimum is None else rows(blocks.minimum), blocks.kind)


def read_blocks(gguf_file: Path) -> dict[str, Blocks]:
    """Every Q4_1 and Q8_0 tensor of a Llama-family GGUF file, by its Hugging Face parameter name (the tied
    embedding as ``model.embed_tokens.weight``). Tensors in other formats (the norms: F32) are left out."""
    import gguf  # transformers' GGUF reader needs it too: installed with the course

    reader = gguf.GGUFReader(gguf_file)
    architecture = reader.fields["general.architecture"].contents()  # "llama" for the course model
    heads = int(reader.fields[f"{architecture}.attention.head_count"].contents())
    kv_heads = int(reader.fields[f"{architecture}.attention.head_count_kv"].contents())
    readers = {"Q4_1": q4_1, "Q8_0": q8_0}
    found: dict[str, Blocks] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in readers:
            continue
        blocks = readers[tensor.tensor_type.name](np.asarray(tensor.data))
        if tensor.name == "token_embd.weight":
            found["model.embed_tokens.weight"] = blocks
            continue
        _, layer, part, _ = tensor.name.split(".")  # "blk", "3", "attn_q", "weight"
        if part in ("attn_q", "attn_k"):
            blocks = unpermute_rows(blocks, heads if part == "attn_q" else kv_heads)
        found[f"model.layers.{layer}.{LAYER_NAMES[part]}.weight"] = blocks
    return found
