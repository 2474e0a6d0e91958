"""The three attention steps of ``attention.py`` as Triton kernels, for CUDA.

Same interface, same results (the tests compare them with the PyTorch reference under
``TRITON_INTERPRET=1``, which runs each kernel on the CPU one program at a time). What the kernels
do that the reference does not:

* ``write_kv``: one program per new token copies its K and V rows into their slots (none for slot
  -1); no index tensor of the whole pool is built.
* ``extend_attention``: flash attention over a ragged batch. A program owns BLOCK_M new queries of
  one sequence and one head, streams that sequence's keys from the pool in tiles of BLOCK_N (each
  key found through the block table: cached tokens and this step's alike) and keeps a running
  (max, sum) softmax, the *online softmax*, so the [n, L] score matrix never exists in memory.
* ``decode_attention``: one program per (sequence, KV head). It walks the sequence's block table one
  block at a time, and all query heads that share the KV head (grouped-query attention) are served
  from the same load of K and V.

Kernels want power-of-two tile sizes. The block size is one (16 to 128); a head size that is not
(80, 96, 112) is padded to the next power of two inside the kernels, and the padding lanes are
masked on every load and store, so they read nothing and write nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# --- write_kv ------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * ROW can pass 2**31 in a large pool
    if slot >= 0:  # slot -1: a padding row, written nowhere
        offs = tl.arange(0, ROW_PAD)  # one token's K (or V) for every KV head: Hkv * D numbers
        mask = offs < ROW
        tl.store(k_cache_ptr + slot * ROW + offs, tl.load(k_ptr + token * ROW + offs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, tl.load(v_ptr + token * ROW + offs, mask=mask), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's key and value in its cache slot; a slot of -1 stores nothing."""
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N, S, Hkv, D] (contiguous); slot_mapping: [T]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping,
                                    ROW=row, ROW_PAD=triton.next_power_of_2(row))


# --- extend: causal flash attention of each sequence's new tokens over its whole cache --------------------


# The block table's width changes from step to step (the longest sequence's block count), and Triton
# would compile a new variant whenever its stride changes divisibility: so it is not specialized on.
@triton.jit(do_not_specialize=["stride_bt"])
def _extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
                   scale, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    m_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= query_len:
        return  # this sequence has fewer new tokens than the longest one in the step
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len  # tokens of earlier steps: new token i sits at position num_cached + i
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # which of the sequence's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)  # the head size, padded to a power of two
    in_head = offs_d < HEAD_DIM  # False on the padding lanes: loaded as 0, never stored

    q_rows = (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_rows, mask=(offs_m < query_len)[:, None] & in_head[None, :], other=0.0)  # [BLOCK_M, Dp]
    if UPCAST:
        q = q.to(tl.float32)
    q_positions = num_cached + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each query's scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - max)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)  # running sum of weights * values
    # Causal: keys past this tile's last query can be skipped entirely.
    kv_end = tl.minimum(num_cached + (m_block + 1) * BLOCK_M, seq_len)
    for n_start in range(0, kv_end, BLOCK_N):
        keys = n_start + offs_n  # key positions in the sequence
        in_seq = keys < seq_len
        # The page table lookup, one per key: its block, then its slot in the block.
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        rows = block[:, None] * stride_cb + (keys % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch \
            + offs_d[None, :]
        k = tl.load(k_cache_ptr + rows, mask=in_seq[:, None] & in_head[None, :], other=0.0)  # [BLOCK_N, Dp]
        v = tl.load(v_cache_ptr + rows, mask=in_seq[:, None] & in_head[None, :], other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        visible = (q_positions[:, None] >= keys[None, :]) & in_seq[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Online softmax: rescale what was summed so far to the new running max. Key 0 is visible
        # to every query, so after the first tile m_new is finite and no row divides by zero.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_rows = (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty),
             mask=(offs_m < query_len)[:, None] & in_head[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                     scale: float) -> torch.Tensor:
    """Each sequence's new tokens attend causally to its whole cache (earlier steps' and this step's)."""
    # q: [T, H, D]; caches: [N, S, Hkv, D]; query_start_loc: [B + 1]; seq_lens: [B]; block_tables: [B, max_blocks]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert _is_power_of_two(block_size) and k_cache.stride() == v_cache.stride()
    q = q.contiguous()
    out = torch.empty_like(q)
    block = 16 if _interpreted() else 64  # the interpreter runs each program in numpy: keep tiles small
    grid = (triton.cdiv(max_query_len, block), seq_lens.shape[0], num_heads)
    _extend_kernel[grid](q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                         q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         block_tables.stride(0), out.stride(0), out.stride(1),
                         GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
                         BLOCK_SIZE=block_size, BLOCK_M=block, BLOCK_N=block, PRECISION=_dot_precision(q.dtype),
                         UPCAST=_interpreted() and q.dtype != torch.float32)
    return out


# --- decode: one query per sequence, keys and values read through the block table ----------------------


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, scale,
                   stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob, stride_oh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, GROUP_PAD)  # the query heads that share this KV head
    offs_s = tl.arange(0, BLOCK_SIZE)  # slots within one block
    offs_d = tl.arange(0, HEAD_PAD)  # the head size, padded to a power of two
    in_head = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None] & in_head[None, :], other=0.0).to(tl.float32)  # [GROUP_PAD, Dp]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)  # the page table lookup
        in_context = j * BLOCK_SIZE + offs_s < seq_len  # the last block may be partly filled
        rows = block * stride_cb + offs_s[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
        mask = in_context[:, None] & in_head[None, :]
        k = tl.load(k_cache_ptr + rows, mask=mask, other=0.0).to(tl.float32)  # [S, Dp]
        v = tl.load(v_cache_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        # One query row per head is too thin for tl.dot's 16-row minimum: multiply and sum instead.
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, S]
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every visited block has slot 0 in context
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None] & in_head[None, :])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Each sequence's single query attends to all of its cached tokens (its own new one included)."""
    # q: [B, H, D]; caches: [N, S, Hkv, D]; block_tables: [B, max_blocks]; seq_lens: [B] -> [B, H, D]
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert _is_power_of_two(block_size) and block_size >= 16
    assert k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size)
    return out


# --- helpers -------------------------------------------------------------------------------------------


def _interpreted() -> bool:
    """Running in Triton's interpreter (the CPU tests). Its ``tl.dot`` multiplies the raw bits of 16-bit
    floats (Triton 3.9), so there the extend kernel upcasts its dot operands to float32 (UPCAST); on a
    GPU the products run in bfloat16 on the tensor cores."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    """Exact float32 products for float32 (the tests compare to 1e-4); tensor cores for 16-bit types."""
    return "ieee" if dtype == torch.float32 else "tf32"
