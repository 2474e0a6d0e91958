"""Paged attention: one interface, two implementations.

Keys and values no longer live in one tensor per request. Each layer has a pool of fixed-size
blocks, ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and the same for V, and a
sequence's tokens are scattered over the blocks its *block table* lists::

    token position p of a sequence  ->  block  block_table[p // block_size],  offset  p % block_size
    its cache slot (a row of the pool viewed as [num_blocks * block_size, ...]) = block * block_size + offset

Attention therefore does three things:

1. ``write_kv``: store this step's new K and V in their slots (the *slot mapping* lists them).
2. Prefill: a prompt's tokens attend causally to each other. They were all computed in this very
   step, so the reference reads them straight from ``k`` and ``v`` instead of from the pool.
3. Decode: each sequence's one new query attends to every cached token, found through its block table.

The PyTorch functions here are the reference: short, obviously right, and fast enough on a CPU.
``triton_attention.py`` has the same three functions as Triton kernels; ``paged_attention`` picks
those on CUDA (or when ``LLM_ATTENTION=triton``), and the tests check that both agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step, besides the tensors of the step's tokens.

    A step is either a prefill (whole prompts) or a decode (one new token per sequence). Sequences
    are laid end to end: the step's T tokens are ragged, not padded to the longest.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64: the cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # [B, max_blocks] int32: each sequence's blocks, padded with 0
    context_lens: torch.Tensor  # [B] int32: tokens in the cache after this step, per sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32: where each sequence's tokens start in the step's T
    max_seqlen: int  # the longest sequence's new tokens in this step (1 when decoding)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def use_triton(device: torch.device) -> bool:
    """Triton kernels on CUDA; ``LLM_ATTENTION=triton`` or ``=torch`` forces a choice (tests use both)."""
    choice = os.environ.get("LLM_ATTENTION", "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"LLM_ATTENTION must be auto, torch or triton, not {choice!r}")
    return choice == "triton" or (choice == "auto" and device.type == "cuda")


# --- the reference (PyTorch) -----------------------------------------------------------------------


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's key and value in its cache slot."""
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N, S, Hkv, D] (N blocks of S slots); slot_mapping: [T]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = v


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention within each prompt of a ragged batch; prompts never see each other."""
    # q: [T, H, D]; k, v: [T, Hkv, D]; cu_seqlens: [B + 1] -> out: [T, H, D]
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]  # query heads per KV head (grouped-query attention)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs = q[start:end].transpose(0, 1)  # [H, L, D]
        ks = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        vs = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Every sequence's cached keys (or values) in token order, read through its block table.

    Each row has ``max_blocks * block_size`` positions; those at or past a sequence's context
    length hold whatever its padding blocks hold, and attention must mask them out."""
    # cache: [N, S, Hkv, D]; block_tables: [B, max_blocks] -> [B, max_blocks * S, Hkv, D]
    # index_select, not cache[block_tables]: the same copy, several times faster on CPU.
    blocks = cache.index_select(0, block_tables.flatten())  # [B * max_blocks, S, Hkv, D]
    return blocks.view(block_tables.shape[0], -1, *cache.shape[2:])


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Each sequence's single query attends to all of its cached tokens (its own new one included).

    The whole batch at once: gather every sequence's keys and values into a padded [B, L] layout,
    then one masked attention. No Python loop over the sequences."""
    # q: [B, H, D]; caches: [N, S, Hkv, D]; block_tables: [B, max_blocks]; context_lens: [B] -> [B, H, D]
    keys = gather_kv(k_cache, block_tables).transpose(1, 2)  # [B, Hkv, L, D]
    values = gather_kv(v_cache, block_tables).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=q.device)
    visible = positions[None, :] < context_lens[:, None]  # [B, L]: False on padding
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=visible[:, None, None, :], scale=scale,
        enable_gqa=True)  # [B, H, 1, D]: each KV head serves its group of query heads
    return out[:, :, 0]


# --- the one entry point the model calls ------------------------------------------------------------


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the pool, then attend: prefill or decode, PyTorch or Triton."""
    # q: [T, H, D]; k, v: [T, Hkv, D]; caches: [N, S, Hkv, D] -> out: [T, H, D]
    if use_triton(q.device):
        from . import triton_attention as impl  # imported only where it runs: triton needs a GPU or the interpreter

        impl.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return impl.prefill_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, scale)
        return impl.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_prefill:
        return prefill_attention(q, k, v, meta.cu_seqlens, scale)
    return decode_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
