"""Paged attention: one interface, two implementations.

Keys and values do not live in one tensor per request: each layer has a pool of fixed-size
blocks, ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and the same for V, and a
sequence's tokens are scattered over the blocks its *block table* lists::

    token position p of a sequence  ->  block  block_table[p // block_size],  offset  p % block_size
    its cache slot (a row of the pool viewed as [num_blocks * block_size, ...]) = block * block_size + offset

Every step has one shape, *extend*: each sequence adds ``query_len`` new tokens to the
``seq_len - query_len`` it already has in the cache. A prompt's prefill is (0 cached, n new), a decode
step (L, 1); the same shape holds a prompt whose first h tokens are cached (h, n - h), a prefill chunk
(c, m) and a speculative check (L, k + 1), with no new kind of attention. Attention therefore does
three things:

1. ``write_kv``: store this step's new K and V in their slots (the *slot mapping* lists them; a slot
   of -1 means "write nothing", for rows that are only padding).
2. Extend: each new token attends causally to its sequence's cache, which now holds the tokens of
   earlier steps and of this one, read through the block table.
3. Decode, the most common case (every sequence adds one token): one query per sequence attends
   to all of its cached tokens. It is extend with ``query_len == 1``, done by a kernel made for it.

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
    """What one step's attention needs to know, besides the tensors of the step's tokens.

    The B sequences' new tokens are laid end to end, T in all, not padded to the longest.
    """

    slot_mapping: torch.Tensor  # [T] int64: the cache slot each new token's K/V goes to (-1: nowhere)
    query_start_loc: torch.Tensor  # [B + 1] int32: where each sequence's new tokens start in the step's T
    query_lens: torch.Tensor  # [B] int32: new tokens per sequence
    seq_lens: torch.Tensor  # [B] int32: cached + new, the tokens each sequence's queries can see
    block_tables: torch.Tensor  # [B, max_blocks] int32: each sequence's blocks, padded with 0
    max_query_len: int  # the most new tokens of any sequence (1: every sequence decodes one token)
    logits_indices: torch.Tensor  # [N] int64: the rows of T whose logits the step needs


def use_triton(device: torch.device) -> bool:
    """Triton kernels on CUDA; ``LLM_ATTENTION=triton`` or ``=torch`` forces a choice (tests use both)."""
    choice = os.environ.get("LLM_ATTENTION", "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"LLM_ATTENTION must be auto, torch or triton, not {choice!r}")
    return choice == "triton" or (choice == "auto" and device.type == "cuda")


# --- the reference (PyTorch) -----------------------------------------------------------------------


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's key and value in its cache slot; a slot of -1 stores nothing."""
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N, S, Hkv, D] (N blocks of S slots); slot_mapping: [T]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    real = slot_mapping >= 0  # [T]: -1 marks a padding row, which must never land in a real block
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping[real]] = k[real]
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping[real]] = v[real]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's cached keys (or values) in token order, read through its block table."""
    # cache: [N, S, Hkv, D]; block_table: [max_blocks] -> [seq_len, Hkv, D]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    # index_select, not cache[block_table]: the same copy, several times faster on CPU.
    blocks = cache.index_select(0, block_table[:num_blocks])  # [num_blocks, S, Hkv, D]
    return blocks.flatten(0, 1)[:seq_len]  # the last block may be only partly filled


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``scaled_dot_product_attention``; on a CPU, 16-bit inputs are computed in float32 and the output cast back.

    Without native bfloat16 instructions (AVX2 only: no AVX512-BF16 or AMX) PyTorch's CPU kernel is several times
    slower on 16-bit inputs than on float32 ones: a decode of 16 sequences of 256 tokens (9 query heads, 3 KV heads
    of 64) takes 2.4 ms in bfloat16, 0.34 ms in float32 and 0.5-0.8 ms cast to float32 and back. It accumulates in
    float32 either way, so the upcast answer is as accurate or better. (CUDA runs its own 16-bit kernels.)"""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Each sequence's single query attends to all of its cached tokens (its own new one included)."""
    # q: [B, H, D]; caches: [N, S, Hkv, D]; block_tables: [B, max_blocks]; seq_lens: [B] -> [B, H, D]
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i, seq_len in enumerate(seq_lens.tolist()):
        ### BEGIN SOLUTION 3.3
        keys = gather_kv(k_cache, block_tables[i], seq_len).repeat_interleave(group, dim=1)  # [L, H, D]
        values = gather_kv(v_cache, block_tables[i], seq_len).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), keys.float()) * scale  # [H, L]
        weights = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", weights, values.float()).to(q.dtype)
        ### END SOLUTION
    return out


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Each sequence's new tokens attend causally to its whole cache: what earlier steps stored and
    what this step just wrote. New token i of a sequence sits at position seq_len - query_len + i and
    sees every position up to its own."""
    # q: [T, H, D]; caches: [N, S, Hkv, D] -> out: [T, H, D]
    out = torch.empty_like(q)
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        keys = gather_kv(k_cache, meta.block_tables[i], seq_len).transpose(0, 1)  # [Hkv, L, D]
        values = gather_kv(v_cache, meta.block_tables[i], seq_len).transpose(0, 1)
        # As a batch of one, [1, H, n, D]: 4-D inputs take PyTorch's fused (flash) CPU kernel, which works
        # through the keys a block at a time; 3-D inputs take its unfused path, which holds every [H, n, L]
        # score at once (324 MB a layer for a 3,000-token prompt) and is three times slower.
        if end - start == seq_len:  # nothing cached before these tokens: plain causal attention, where the
            visible = None  # kernel skips the key blocks above the diagonal (half of the work)
        else:
            query_positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)  # [n]
            visible = torch.arange(seq_len, device=q.device)[None, :] <= query_positions[:, None]  # [n, L]
        o = _sdpa(q[start:end].transpose(0, 1)[None], keys[None], values[None], attn_mask=visible,
                  is_causal=visible is None, scale=scale, enable_gqa=True)  # [1, H, n, D]
        out[start:end] = o[0].transpose(0, 1)  # [n, H, D]
    return out


# --- the one entry point the model calls ------------------------------------------------------------


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the pool, then attend: extend or decode, PyTorch or Triton."""
    # q: [T, H, D]; k, v: [T, Hkv, D]; caches: [N, S, Hkv, D] -> out: [T, H, D]
    decode = meta.max_query_len == 1  # one new token per sequence: T == B
    if use_triton(q.device):
        from . import triton_attention as impl  # imported only where it runs: triton needs a GPU or the interpreter

        impl.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if decode:
            return impl.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        return impl.extend_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                     meta.max_query_len, scale)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if decode:
        return decode_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    return extend_attention_reference(q, k_cache, v_cache, meta, scale)
