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
   of -1 means "write nothing", for rows that are only padding). From stage 07 on the model does this
   in the same kernel that rotates the keys (``fused.rotary_and_write_kv``), before ``paged_attention``.
2. Extend: each new token attends causally to its sequence's cache, which now holds the tokens of
   earlier steps and of this one, read through the block table.
3. Decode, the most common case (every sequence adds one token): one query per sequence attends
   to all of its cached tokens. It is extend with ``query_len == 1``, done by a kernel made for it.

The PyTorch functions here are the reference: short, obviously right, and fast enough on a CPU.
``triton_attention.py`` has the same three functions as Triton kernels; ``paged_attention`` picks
those on CUDA (or when ``LLM_ATTENTION=triton``), and the tests check that both agree. (On that path
the model stores K/V with the fused kernel, which the tests check against ``write_kv``.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

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

    # What every layer would otherwise work out again from the tensors above: computed by the first layer that
    # asks (cached_property), read by the others. A step's metadata is built anew for every forward pass.
    @cached_property
    def kv_writes(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the rows of T that store their K/V, or None: all of them; their slots)."""
        real = self.slot_mapping >= 0  # [T]: -1 marks a padding row, which must never land in a real block
        if bool(real.all()):
            return None, self.slot_mapping
        rows = real.nonzero().flatten()
        return rows, self.slot_mapping[rows]

    _decode_groups: list[DecodeGroup] | None = field(default=None, init=False, repr=False)

    def decode_groups(self, block_size: int) -> list[DecodeGroup]:
        """The decode step's rows in groups of similar length, with their block ids and masks: the same for
        every layer (the PyTorch path's; the Triton kernel reads the block tables itself)."""
        if self._decode_groups is None:
            self._decode_groups = decode_groups(self.block_tables, self.seq_lens, block_size)
        return self._decode_groups


def use_triton(device: torch.device) -> bool:
    """Triton kernels on CUDA; ``LLM_ATTENTION=triton`` or ``=torch`` forces a choice (tests use both)."""
    choice = os.environ.get("LLM_ATTENTION", "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"LLM_ATTENTION must be auto, torch or triton, not {choice!r}")
    return choice == "triton" or (choice == "auto" and device.type == "cuda")


# --- the reference (PyTorch) -----------------------------------------------------------------------


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, writes: tuple[torch.Tensor | None, torch.Tensor] | None = None) -> None:
    """Store each new token's key and value in its cache slot; a slot of -1 stores nothing.

    ``writes``: the rows that store and their slots, when the caller worked them out once for every layer
    (``AttentionMetadata.kv_writes``)."""
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N, S, Hkv, D] (N blocks of S slots); slot_mapping: [T]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if writes is None:
        real = slot_mapping >= 0  # [T]: -1 marks a padding row, which must never land in a real block
        writes = real.nonzero().flatten(), slot_mapping[real]
    rows, slots = writes  # rows None: every row stores
    k, v = (k, v) if rows is None else (k[rows], v[rows])
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Every sequence's cached keys (or values) in token order, read through its block table.

    Each row has ``max_blocks * block_size`` positions; those at or past a sequence's context
    length hold whatever its padding blocks hold, and attention must mask them out."""
    # cache: [N, S, Hkv, D]; block_tables: [B, max_blocks] -> [B, max_blocks * S, Hkv, D]
    # index_select, not cache[block_tables]: the same copy, several times faster on CPU.
    blocks = cache.index_select(0, block_tables.flatten())  # [B * max_blocks, S, Hkv, D]
    return blocks.view(block_tables.shape[0], -1, *cache.shape[2:])


def length_groups(seq_lens: torch.Tensor, shortest: int = 256) -> list[torch.Tensor]:
    """The batch's rows sorted by length, in groups whose longest is at most twice their first
    (lengths up to ``shortest`` all in the first group): padding a group to its longest then wastes
    at most half of it. Rows of length 0 are in none."""
    lengths, order = torch.sort(seq_lens)
    ### BEGIN SOLUTION 7.2
    real = lengths > 0  # a bucket's padding row has context length 0: it joins no group
    lengths, order = lengths[real], order[real]
    if len(lengths) == 0:
        return []
    ### END SOLUTION
    groups, first = [], 0
    for i, length in enumerate(lengths.tolist()):
        if length > 2 * max(int(lengths[first]), shortest):
            groups.append(order[first:i])
            first = i
    return [*groups, order[first:]]


@dataclass
class DecodeGroup:
    """Decode rows that share one padded layout of L = blocks * block_size positions."""

    rows: torch.Tensor | None  # [G]: the batch's rows in the group; None: all of them, in order
    tables: torch.Tensor  # [G, blocks]: their block tables cut to the group's longest, contiguous (gathered as is)
    visible: torch.Tensor  # [G, 1, 1, L] bool: False on padding (broadcast over heads and the one query)


def decode_groups(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> list[DecodeGroup]:
    """``length_groups``, each with what attention reads: its block ids and the mask of its padding."""
    groups: list[torch.Tensor | None] = list(length_groups(seq_lens))
    if len(groups) == 1 and len(groups[0]) == len(seq_lens):  # one group of every row: keep the batch's order
        groups = [None]
    result = []
    for rows in groups:
        lens = seq_lens if rows is None else seq_lens[rows]  # [G]
        tables = (block_tables if rows is None else block_tables[rows])[:, : -(-int(lens.max()) // block_size)]
        positions = torch.arange(tables.shape[1] * block_size, device=seq_lens.device)  # [L]
        visible = positions[None, :] < lens[:, None]  # [G, L]: False on padding
        result.append(DecodeGroup(rows, tables.contiguous(), visible[:, None, None, :]))  # tables: [G, blocks]
    return result


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
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               groups: list[DecodeGroup] | None = None) -> torch.Tensor:
    """Each sequence's single query attends to all of its cached tokens (its own new one included).

    Many sequences at once: gather their keys and values into a padded [B, L] layout, then one
    masked attention, no Python loop over the sequences. Padding costs as much as real keys, so
    sequences of very different lengths (one 3,000-token document among 200-token chats) do not
    share one layout: they go in groups of similar length, each padded to its own longest. A row of
    context length 0 (a padding row of a bucket) is in no group and its output stays zero.

    ``groups``: the step's ``decode_groups``, when the caller worked them out once for every layer."""
    # q: [B, H, D]; caches: [N, S, Hkv, D]; block_tables: [B, max_blocks]; seq_lens: [B] -> [B, H, D]
    groups = decode_groups(block_tables, seq_lens, k_cache.shape[1]) if groups is None else groups
    out = None if len(groups) == 1 and groups[0].rows is None else torch.zeros_like(q)
    for group in groups:
        keys = gather_kv(k_cache, group.tables).transpose(1, 2)  # [G, Hkv, L, D]
        values = gather_kv(v_cache, group.tables).transpose(1, 2)
        rows_q = q if group.rows is None else q[group.rows]  # [G, H, D]
        o = _sdpa(rows_q[:, :, None, :], keys, values, attn_mask=group.visible, scale=scale,
                  enable_gqa=True)  # [G, H, 1, D]: each KV head serves its group of query heads
        if out is None:  # every row in one group, in order: its output is the whole answer
            return o[:, :, 0]
        out[group.rows] = o[:, :, 0]
    return out


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Each sequence's new tokens attend causally to its whole cache: what earlier steps stored and
    what this step just wrote. New token i of a sequence sits at position seq_len - query_len + i and
    sees every position up to its own.

    A mixed step is mostly decode rows and a few prompt chunks: the decode rows (one new
    token) go through ``decode_attention_reference`` together, the chunks one at a time."""
    # q: [T, H, D]; caches: [N, S, Hkv, D] -> out: [T, H, D]
    out = torch.empty_like(q)
    decoding = (meta.query_lens == 1).nonzero().flatten()  # [Bd]: the sequences with one new token
    if len(decoding):
        rows = meta.query_start_loc[decoding]  # [Bd]: their one row each
        out[rows] = decode_attention_reference(q[rows], k_cache, v_cache, meta.block_tables[decoding],
                                               meta.seq_lens[decoding], scale)
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for i in (meta.query_lens > 1).nonzero().flatten().tolist():
        start, end, seq_len = starts[i], starts[i + 1], seq_lens[i]
        table = meta.block_tables[i : i + 1, : -(-seq_len // k_cache.shape[1])]  # [1, its blocks]: none of the padding
        keys = gather_kv(k_cache, table)[0, :seq_len].transpose(0, 1)  # [Hkv, L, D]
        values = gather_kv(v_cache, table)[0, :seq_len].transpose(0, 1)
        # As a batch of one, [1, H, n, D]: 4-D inputs take PyTorch's fused (flash) CPU kernel, which works
        # through the keys a block at a time; 3-D inputs take its unfused path, which holds every [H, n, L]
        # score at once (324 MB a layer for a 3,000-token prompt) and is three times slower.
        if end - start == seq_len:  # nothing cached before these tokens: plain causal attention, where the
            visible = None  # kernel skips the key blocks above the diagonal (half of the work)
        else:
            ### BEGIN SOLUTION 6.3
            # The chunk's n queries come after seq_len - n tokens already in the cache (a cached prefix, earlier
            # chunks): query j sits at position seq_len - n + j and sees every key up to there, no further.
            query_positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)  # [n]
            visible = torch.arange(seq_len, device=q.device)[None, :] <= query_positions[:, None]  # [n, L]
            ### END SOLUTION
        o = _sdpa(q[start:end].transpose(0, 1)[None], keys[None], values[None], attn_mask=visible,
                  is_causal=visible is None, scale=scale, enable_gqa=True)  # [1, H, n, D]
        out[start:end] = o[0].transpose(0, 1)  # [n, H, D]
    return out


# --- the one entry point the model calls ------------------------------------------------------------


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attend over the pool, which already holds this step's K/V (``fused.rotary_and_write_kv`` stored them, in
    the kernel that rotates the keys): extend or decode, PyTorch or Triton."""
    # q: [T, H, D]; caches: [N, S, Hkv, D] -> out: [T, H, D]
    decode = meta.max_query_len == 1  # one new token per sequence: T == B
    if use_triton(q.device):
        from . import triton_attention as impl  # imported only where it runs: triton needs a GPU or the interpreter

        if decode:
            return impl.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        return impl.extend_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                     meta.max_query_len, scale)
    if decode:
        return decode_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                          meta.decode_groups(k_cache.shape[1]))
    return extend_attention_reference(q, k_cache, v_cache, meta, scale)
