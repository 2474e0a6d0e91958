"""The three attention steps of ``attention.py`` as Triton kernels, for CUDA.

Same interface, same results: the tests compare them with the PyTorch reference, which stays the
oracle (on a CPU under ``TRITON_INTERPRET=1``, which runs each kernel in numpy one program at a time).
The reference says *what* is computed; these kernels are about doing it at the speed of the GPU's
memory. Three ideas carry them:

* **Tiles through the page table.** A tile of BLOCK_N keys (64 in decode; prefill's tiles are tuned) is
  read with one vector of block ids, ``block_table[keys // block_size]``, whatever the block size: a
  16-token page does not mean 16-token loads.
* **Online softmax** (flash attention): a running (max, sum) per query row, rescaled as each tile
  arrives, so the [queries, keys] score matrix never exists in memory. Scores live in base 2
  (``exp2``, with log2(e) folded into the scale): the GPU's native exponential.
* **Enough programs for the whole GPU.** An H100 has 132 multiprocessors. Decoding one sequence
  with 3 KV heads would occupy 3 of them if each (sequence, KV head) were one program, so decode
  splits long contexts across programs (*flash-decoding*) and a second small kernel merges the
  pieces; prefill has a program per (BLOCK_M queries, sequence, head), plenty already.

The kernels:

* ``write_kv``: one program per new token copies its K and V rows into their slots (none for slot -1).
* ``extend_attention``: causal flash attention of a ragged batch's new tokens over each sequence's
  whole cache. The key tiles wholly before a query tile's first position need no causal mask; only
  the tiles on the diagonal pay for it. The tile sizes are autotuned on the first call of each size of
  query (``query_rows_bucket``: a 5-row verification is not tuned as an 8,192-token prompt).
* ``decode_attention``: one query per sequence. The query heads that share a KV head (grouped-query
  attention) are padded to 16 rows, the smallest ``tl.dot``, so the tensor cores do the products and
  each K/V tile is loaded once for the whole group.

Pool offsets are computed in int64: a pool of more than 2**31 numbers (a few GB) is ordinary. A
head size that is not a power of two (80, 96, 112) is padded to the next one inside the kernels, the
padding lanes masked on every load and store. Nothing depends on values that change from step to
step (the block table's width, the number of splits): Triton would compile a new variant mid-serving.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634  # exp(x) == exp2(x * log2(e))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _interpreted() -> bool:
    """Running in Triton's interpreter (the CPU tests). Its ``tl.dot`` multiplies the raw bits of 16-bit
    floats (Triton 3.9), so there the kernels upcast their dot operands to float32 (UPCAST); on a GPU
    the products run in 16 bits on the tensor cores."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    """Exact float32 products for float32 (the tests compare to 1e-4); tensor cores for 16-bit types."""
    return "ieee" if dtype == torch.float32 else "tf32"


# --- write_kv ------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * ROW can pass 2**31 in a large pool
    if slot >= 0:  # slot -1: a padding row, written nowhere
        offs = tl.arange(0, ROW_PAD)  # one token's K (or V) for every KV head: Hkv * D numbers
        mask = offs < ROW
        src = token.to(tl.int64) * ROW + offs
        tl.store(k_cache_ptr + slot * ROW + offs, tl.load(k_ptr + src, mask=mask), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, tl.load(v_ptr + src, mask=mask), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's key and value in its cache slot; a slot of -1 stores nothing."""
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N, S, Hkv, D] (contiguous); slot_mapping: [T]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping,
                                    ROW=row, ROW_PAD=triton.next_power_of_2(row))


# --- the pieces both attention kernels are made of ----------------------------------------------------


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, keys, in_seq, kv_head, stride_cb, stride_cs, stride_ch,
                  offs_d, in_head, BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V of the key positions ``keys`` of one sequence, [BLOCK_N, HEAD_PAD] each, found through its
    block table: the page-table lookup, one block id per key. Keys outside ``in_seq`` read as 0."""
    block = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    rows = block[:, None] * stride_cb + (keys % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch \
        + offs_d[None, :]
    mask = in_seq[:, None] & in_head[None, :]
    k = tl.load(k_cache_ptr + rows, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + rows, mask=mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax(m_i, l_i, acc, scores, v, PRECISION: tl.constexpr):
    """Fold one tile of (base-2) scores [M, N] and its values [N, Dp] into the running max m_i [M], sum of
    exponentials l_i [M] and weighted sum of values acc [M, Dp]. A row whose scores are all -inf so far
    must not reach here: the callers make sure each row sees at least one key in its first tile."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# --- extend: causal flash attention of each sequence's new tokens over its whole cache --------------------


def _extend_configs() -> list[triton.Config]:
    """The tile sizes the autotuner tries on the first call, a handful so that start-up stays short. The
    interpreter gets one small tile: it runs each program in numpy."""
    if _interpreted():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in [(64, 32, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)]]


def query_rows_bucket(max_query_len: int) -> int:
    """The tuning key for a step's longest query: 16 (a verification's 1 + K rows, a short chunk), 128, 1024, or
    8192 and more, each bucket 8 times the last. The best tile for 5 rows a sequence (BLOCK_M of 64 leaves most of
    it idle) is not the best for a prompt of 8,192: each bucket is tuned apart, four tunings at most."""
    bucket = 16
    while bucket < max_query_len and bucket < 8192:
        bucket *= 8
    return bucket


# The tiles are tuned once per model shape (and dtype) and size of query (``query_rows_bucket``), not per
# step: on CUDA the engine's warm-up makes a call of each bucket (a long step, 1,000 rows, 100 and 2), and the
# CUDA graphs' warm-up runs each verification bucket before capturing it, so no served step pays for tuning.
# The block table's width changes from step to step, and Triton would compile a new variant whenever its stride
# changes divisibility: so it is not specialized on; nor is the query bucket, which only keys the tuning (the
# kernel never reads it).
@triton.autotune(configs=_extend_configs(), key=["HEAD_DIM", "GROUP", "query_rows"])
@triton.jit(do_not_specialize=["stride_bt", "query_rows"])
def _extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
                   qk_scale, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                   query_rows,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= query_len:
        return  # this sequence has fewer new tokens than the longest one in the step
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len  # tokens of earlier steps: new token i sits at position num_cached + i
    kv_head = head // GROUP
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # which of the sequence's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)  # the head size, padded to a power of two
    in_head = offs_d < HEAD_DIM  # False on the padding lanes: loaded as 0, never stored
    in_query = offs_m < query_len

    q_rows = (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_rows, mask=in_query[:, None] & in_head[None, :], other=0.0)  # [BLOCK_M, Dp]
    if UPCAST:
        q = q.to(tl.float32)
    q_positions = num_cached + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each query's (base-2) scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - max)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)  # running sum of weights * values

    # Phase 1: the key tiles wholly before this tile's first query, visible to all of its queries. No
    # causal mask: in a long prompt that is nearly every tile.
    first_query = num_cached + m_block * BLOCK_M
    diagonal_start = (first_query // BLOCK_N) * BLOCK_N
    for n_start in range(0, diagonal_start, BLOCK_N):
        keys = n_start + offs_n
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, keys, keys < seq_len, kv_head,
                             stride_cb, stride_cs, stride_ch, offs_d, in_head, BLOCK_SIZE, UPCAST)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, scores, v, PRECISION)

    # Phase 2: the tiles on the diagonal, where query i sees only keys up to its own position. Keys past
    # this tile's last query are skipped entirely. The first tile here holds a key at or before every
    # query's position, so no row is left with nothing but -inf.
    kv_end = tl.minimum(first_query + BLOCK_M, seq_len)
    for n_start in range(diagonal_start, kv_end, BLOCK_N):
        keys = n_start + offs_n
        in_seq = keys < seq_len
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, keys, in_seq, kv_head,
                             stride_cb, stride_cs, stride_ch, offs_d, in_head, BLOCK_SIZE, UPCAST)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = (q_positions[:, None] >= keys[None, :]) & in_seq[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, scores, v, PRECISION)

    out = acc / l_i[:, None]
    out_rows = (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=in_query[:, None] & in_head[None, :])


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

    def grid(tiles: dict) -> tuple[int, int, int]:  # the autotuner picks BLOCK_M, the grid follows
        return triton.cdiv(max_query_len, tiles["BLOCK_M"]), seq_lens.shape[0], num_heads

    _extend_kernel[grid](q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale * LOG2_E,
                         q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         block_tables.stride(0), out.stride(0), out.stride(1), query_rows_bucket(max_query_len),
                         GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
                         BLOCK_SIZE=block_size, PRECISION=_dot_precision(q.dtype),
                         UPCAST=_interpreted() and q.dtype != torch.float32)
    return out


# --- decode: one query per sequence, the context split across programs, then merged --------------------

DECODE_BLOCK_N = 16 if _interpreted() else 64  # keys per tile
MAX_SPLITS = 32  # a power of two: the merge kernel reads every split's result in one tile
MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more to merge than it saves


@triton.jit(do_not_specialize=["stride_bt", "split_len"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
                   qk_scale, split_len, stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                   GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_heads, num_splits = tl.num_programs(1) * GROUP, tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_len  # this program's share of the context: keys start .. end - 1
    end = tl.minimum(start + split_len, seq_len)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_g = tl.arange(0, ROWS)  # the query heads that share this KV head, padded to 16 rows for tl.dot
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)
    in_group, in_head = offs_g < GROUP, offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=in_group[:, None] & in_head[None, :], other=0.0)  # [ROWS, Dp]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    for n_start in range(start, end, BLOCK_N):  # no iteration at all for a split past the sequence's end
        keys = n_start + offs_n
        in_split = keys < end  # the first tile always holds key `start`: no row is left with only -inf
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, keys, in_split, kv_head,
                             stride_cb, stride_cs, stride_ch, offs_d, in_head, BLOCK_SIZE, UPCAST)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [ROWS, BLOCK_N]
        scores = tl.where(in_split[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, scores, v, PRECISION)

    # This split's answer as if its keys were the whole context, with the log2 of its softmax
    # denominator, lse = max + log2(sum): all the merge needs to weigh it against the other splits.
    # An empty split says lse = -inf, weight 0.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = (seq * num_heads + heads).to(tl.int64) * num_splits + split  # [ROWS]: rows of [B, H, splits]
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=in_group[:, None] & in_head[None, :])
    tl.store(part_lse_ptr + part, lse, mask=in_group)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One program per (sequence, query head): out = sum_s w_s * out_s / sum_s w_s, w_s = 2 ** lse_s, taken
    relative to the largest lse so that nothing overflows. This is the online softmax's rescaling, done
    once across splits instead of tile after tile."""
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_s, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_PAD)
    in_splits, in_head = offs_s < num_splits, offs_d < HEAD_DIM
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=in_splits, other=float("-inf"))  # [SPLITS_PAD]
    # A bucket's padding row (context length 0) has no key in any split: every lse is -inf, and
    # -inf - -inf would be NaN. Its largest lse is taken as 0 instead, so every weight is 0 and out is 0.
    largest = tl.max(lse, axis=0)
    largest = tl.where(largest == float("-inf"), 0.0, largest)
    weight = tl.exp2(lse - largest)  # [SPLITS_PAD]: 0 for empty splits and padding
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=in_splits[:, None] & in_head[None, :], other=0.0)  # [SPLITS_PAD, Dp]
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=in_head)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Each sequence's single query attends to all of its cached tokens (its own new one included).

    ``num_splits`` programs share each sequence's context (chosen to fill the GPU when not given)."""
    # q: [B, H, D]; caches: [N, S, Hkv, D]; block_tables: [B, max_blocks]; seq_lens: [B] -> [B, H, D]
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert _is_power_of_two(block_size) and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv_heads
    # The longest context the block table can describe: known on the host without reading seq_lens
    # back from the GPU (a sync that would also make the step impossible to capture in a CUDA graph).
    tiles = triton.cdiv(block_tables.shape[1] * block_size, DECODE_BLOCK_N)
    if num_splits is None:
        num_splits = _num_splits(num_seqs * num_kv_heads, tiles, q.device)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be 1 to {MAX_SPLITS}, not {num_splits}"
    split_len = triton.cdiv(tiles, num_splits) * DECODE_BLOCK_N  # whole tiles per split
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, part_out, part_lse, block_tables, seq_lens, scale * LOG2_E, split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=DECODE_BLOCK_N,
        PRECISION=_dot_precision(q.dtype), UPCAST=_interpreted() and q.dtype != torch.float32)
    out = torch.empty_like(q)
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), SPLITS_PAD=MAX_SPLITS)
    return out


def _num_splits(programs: int, tiles: int, device: torch.device) -> int:
    """Split each context until the grid has about two programs per multiprocessor, keeping every split
    at least MIN_TILES_PER_SPLIT tiles long. A big batch fills the GPU by itself and gets 1."""
    wanted = triton.cdiv(2 * _multiprocessors(device), programs)
    return max(1, min(wanted, triton.cdiv(tiles, MIN_TILES_PER_SPLIT), MAX_SPLITS))


@cache
def _multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (132 on an H100); 1 for the interpreter, which runs one
    program at a time anyway."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
