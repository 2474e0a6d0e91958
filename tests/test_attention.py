"""Paged attention (stage 03 on): the Triton kernels agree with the PyTorch reference, and the
reference agrees with plain dense attention, in every stage that has them (stage 04's decode
reference is batched).

Each kernel test runs twice: on the CPU, where the kernels run under TRITON_INTERPRET=1, and on a
GPU (marked ``cuda``: ``pytest -m cuda`` is the GPU suite, skipped with a reason where there is none)."""

from __future__ import annotations

import hashlib
import math
import os
import random
from pathlib import Path

import pytest
import torch

from .conftest import make_engine, stage
from .stages import changed_stages_with, graded_first, has, stages_having

ATOL = 1e-4


STAGES = changed_stages_with("attention", "triton_attention")


@pytest.fixture(scope="module", params=STAGES)
def folder(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def attn(folder):
    return stage(folder, "attention")


@pytest.fixture(scope="module")
def kernels(folder):
    return stage(folder, "triton_attention")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    """Where the kernels run: the CPU through Triton's interpreter, or the GPU, compiled."""
    if request.param == "cpu" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton compiles for the GPU on this machine: the kernels are tested in the cuda case")
    return request.param


# A kernel's output is a function of its code and its inputs, and Triton's interpreter is slow. So on the CPU a
# stage whose triton_attention.py is byte-identical to an earlier stage's (04 and 06 have 03's) takes the output
# that file's kernel gave for the very same inputs, and compares it with its own reference: the same assertion on
# the same code, the kernel run once per version of its file. (The file's tests run as one group: one worker.)
KERNEL_OUTPUTS: dict[tuple, torch.Tensor] = {}


def fingerprint(value: object) -> object:
    """A tensor as its dtype, shape and the digest of its bytes; anything else as itself."""
    if not isinstance(value, torch.Tensor):
        return value
    data = value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return str(value.dtype), tuple(value.shape), hashlib.sha256(data).hexdigest()


def remembered(kernels, name: str):
    """``kernels.<name>`` (a kernel that returns a new tensor), run once per version of its file and inputs on the
    CPU; on a GPU, every time (compiled, it is fast)."""
    kernel = getattr(kernels, name)
    version = hashlib.sha256(Path(kernels.__file__).read_bytes()).hexdigest()

    def run(*args, **kwargs) -> torch.Tensor:
        if any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args):
            return kernel(*args, **kwargs)
        key = (version, name, tuple(map(fingerprint, args)), tuple(sorted(kwargs.items())))
        if key not in KERNEL_OUTPUTS:
            KERNEL_OUTPUTS[key] = kernel(*args, **kwargs)
        return KERNEL_OUTPUTS[key].clone()

    return run


def graded(exercise: str) -> pytest.MarkDecorator:
    """Run on every stage; stage 03's run grades homework ``exercise``."""
    return pytest.mark.parametrize("folder", graded_first(STAGES, exercise), indirect=True)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Textbook softmax(q k^T / sqrt(d)) v for one sequence, written independently of the stage."""
    # q: [Lq, H, D]; k, v: [L, Hkv, D] -> [Lq, H, D]; with causal, query i sees keys 0..i (Lq == L)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_case(seed: int, seq_lens: list[int], block_size: int, num_kv_heads: int, group: int,
               head_dim: int = 64, num_queries: list[int] | None = None):
    """A pool with each sequence's keys scattered over shuffled blocks, the dense keys to compare, and
    ``num_queries[i]`` queries per sequence (its last tokens; one each by default, as in a decode)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks that nobody owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, dense = [], []
    for n, count in zip(seq_lens, blocks_per_seq, strict=True):
        table, ids = ids[:count], ids[count:]
        tables.append(table + [0] * (max(blocks_per_seq) - count))
        rows = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        dense.append((k_cache.flatten(0, 1)[rows], v_cache.flatten(0, 1)[rows]))
    num_queries = num_queries or [1] * len(seq_lens)
    q = torch.randn(sum(num_queries), num_kv_heads * group, head_dim, generator=gen)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, lens, dense


def extend_meta(attn, cached_new: list[tuple[int, int]], block_tables: torch.Tensor):
    """The metadata of an extend step: sequence i has cached_new[i][0] tokens cached and adds cached_new[i][1]."""
    query_lens = [new for _, new in cached_new]
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    return attn.AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64),  # the K/V are in the pool already
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in cached_new], dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        logits_indices=torch.tensor(starts[1:], dtype=torch.int64) - 1,
    )


@graded("3.3")
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seq_lens", [[1], [16], [17, 5, 40], [100, 33], [3, 600, 20, 1300]])
def test_decode_reference_equals_dense_attention(attn, seq_lens, group):
    q, k_cache, v_cache, tables, lens, dense = paged_case(0, seq_lens, 16, num_kv_heads=2, group=group)
    out = attn.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale=1 / math.sqrt(64))
    for i, (k, v) in enumerate(dense):
        expected = dense_attention(q[i : i + 1], k, v, causal=False)[0]
        torch.testing.assert_close(out[i], expected, atol=ATOL, rtol=0)



@pytest.mark.parametrize("folder", [folder for folder in STAGES if has(folder, "batching")], indirect=True)
def test_length_groups_hold_every_row_once_and_pad_at_most_twofold(attn):
    """Stage 04's batched decode reference pads each group of rows to its longest: no group may be
    more than twice as long at its end as at its start (short rows excepted), and no row is lost."""
    lens = torch.tensor([700, 3, 1300, 250, 20, 600, 2900, 256, 257, 1400], dtype=torch.int32)
    groups = attn.length_groups(lens, shortest=256)
    rows = torch.cat(groups).tolist()
    assert sorted(rows) == list(range(len(lens)))
    assert [lens[rows].tolist()] == [sorted(lens.tolist())]  # sorted by length
    for group in groups:
        assert int(lens[group].max()) <= 2 * max(int(lens[group].min()), 256), lens[group].tolist()
    assert len(groups) == 4  # [3 .. 257], [600, 700], [1300, 1400], [2900]

# (cached, new) per sequence: whole prompts (0, n), decode-like (L, 1), a prefix hit (h, n - h) and a chunk.
EXTEND_CASES = [[(0, 5)], [(0, 1), (0, 23)], [(16, 16)], [(7, 3), (0, 12), (40, 1)], [(31, 2), (100, 30)]]
# What a prefix cache (stage 05) hands the kernel: hits of whole blocks, a prompt cached but for its last
# token (a block-aligned prompt seen before), and hits beside misses in one ragged batch.
PREFIX_HIT_CASES = [[(32, 16), (0, 9), (47, 1)], [(64, 3), (0, 1), (16, 40)]]
# What chunked prefill (stage 06) hands it: decode rows with chunks at odd offsets, partial blocks on both ends.
MIXED_CASES = [[(40, 1), (7, 33), (100, 1), (0, 7), (16, 1)], [(1, 1), (33, 16), (129, 3), (64, 1)]]


def random_mixed_step(seed: int) -> list[tuple[int, int]]:
    """A mixed step as the stage 06 scheduler builds one: mostly decode rows (L, 1), then a few prompt chunks
    (c, n) that start and end anywhere in a block."""
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 200), 1) for _ in range(rng.randint(1, 6))]
    chunks = [(rng.choice([0, rng.randint(1, 150)]), rng.randint(2, 40)) for _ in range(rng.randint(1, 3))]
    return decodes + chunks


@pytest.mark.parametrize("cached_new", [*EXTEND_CASES, *MIXED_CASES], ids=str)
def test_extend_reference_equals_dense_causal_attention(attn, cached_new):
    """New token i of a sequence with c cached tokens is row c + i of dense causal attention over all of them."""
    seq_lens, num_new = [c + n for c, n in cached_new], [n for _, n in cached_new]
    q, k_cache, v_cache, tables, _, dense = paged_case(1, seq_lens, 16, num_kv_heads=2, group=3, head_dim=32,
                                                       num_queries=num_new)
    meta = extend_meta(attn, cached_new, tables)
    out = attn.extend_attention_reference(q, k_cache, v_cache, meta, scale=1 / math.sqrt(32))
    start = 0
    for (cached, new), (k, v) in zip(cached_new, dense, strict=True):
        # The dense reference sees every token as a query; only the new ones' rows are compared.
        full_q = torch.cat([torch.zeros(cached, *q.shape[1:]), q[start : start + new]])
        expected = dense_attention(full_q, k, v, causal=True)[cached:]
        torch.testing.assert_close(out[start : start + new], expected, atol=ATOL, rtol=0)
        start += new


def test_a_decode_step_is_an_extend_of_one_token(attn):
    """The decode path is the extend step's special case: both give the same numbers."""
    q, k_cache, v_cache, tables, lens, _ = paged_case(2, [9, 33, 64], 16, num_kv_heads=1, group=4)
    meta = extend_meta(attn, [(n - 1, 1) for n in lens.tolist()], tables)
    scale = 1 / math.sqrt(64)
    torch.testing.assert_close(attn.extend_attention_reference(q, k_cache, v_cache, meta, scale),
                               attn.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale),
                               atol=ATOL, rtol=0)


# --- Triton against the reference ------------------------------------------------------------------------


def run_decode(kernels, device: str, q, k_cache, v_cache, block_tables, seq_lens, scale: float,
               **options) -> torch.Tensor:
    """The decode kernel on ``device``, its output back on the CPU."""
    on = [t.to(device) for t in (q, k_cache, v_cache, block_tables, seq_lens)]
    return remembered(kernels, "decode_attention")(*on, scale, **options).cpu()


def run_extend(kernels, device: str, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """The extend kernel on ``device``, its output back on the CPU."""
    on = [t.to(device) for t in (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables)]
    return remembered(kernels, "extend_attention")(*on, meta.max_query_len, scale).cpu()


@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 3), (3, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_kernel_fills_the_same_slots_and_skips_minus_one(attn, kernels, num_kv_heads, group, block_size,
                                                                  device):
    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, tokens = 6, 37
    k, v = torch.randn(tokens, num_kv_heads, 64, generator=gen), torch.randn(tokens, num_kv_heads, 64, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1  # padding rows: written nowhere (not to the pool's last slot, which -1 would index)
    reference = [torch.zeros(num_blocks, block_size, num_kv_heads, 64) for _ in range(2)]
    attn.write_kv(k, v, *reference, slots)
    pools = [torch.zeros(num_blocks, block_size, num_kv_heads, 64, device=device) for _ in range(2)]
    kernels.write_kv(k.to(device), v.to(device), *pools, slots.to(device))
    for got, expected in zip(pools, reference, strict=True):
        assert torch.equal(got.cpu(), expected)  # what the kernel wrote into the pools themselves
    real = slots >= 0
    assert reference[0].count_nonzero() == real.sum() * num_kv_heads * 64  # nothing outside the real slots
    flat = reference[0].flatten(0, 1)
    assert torch.equal(flat[slots[real]], k[real])


@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("seed", range(3))
def test_decode_kernel_matches_reference(attn, kernels, num_kv_heads, group, block_size, seed, device):
    rng = random.Random(seed * 100 + block_size + group)
    # Context lengths from 1 to a few hundred: exactly full blocks, partial last blocks, one token.
    seq_lens = [rng.choice([1, block_size, block_size + 1, rng.randint(2, 300)]) for _ in range(3)]
    q, k_cache, v_cache, tables, lens, _ = paged_case(seed, seq_lens, block_size, num_kv_heads, group)
    scale = 1 / math.sqrt(64)
    expected = attn.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    out = run_decode(kernels, device, q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 32])
def test_decode_kernel_gives_the_same_answer_however_the_context_is_split(attn, kernels, num_splits, device):
    """Flash-decoding: each split attends to its share of the keys, the merge weighs the shares by their
    softmax sums. Contexts of 1 token (every split but the first empty), of a block, and longer than the
    splits, side by side in one batch."""
    q, k_cache, v_cache, tables, lens, _ = paged_case(num_splits, [1, 16, 203, 77], 16, num_kv_heads=3, group=3)
    scale = 1 / math.sqrt(64)
    expected = attn.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    out = run_decode(kernels, device, q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_decode_splits_the_context_only_when_the_batch_leaves_the_gpu_idle(kernels, monkeypatch):
    """On a 132-multiprocessor GPU one sequence with 3 KV heads is 3 programs: its context is split. A batch
    of 128 sequences is 384 programs already: no split, no merge to pay for. Short contexts are not split."""
    monkeypatch.setattr(kernels, "_multiprocessors", lambda device: 132)
    gpu = torch.device("cuda")
    assert kernels._num_splits(programs=3, tiles=64, device=gpu) == 16  # 64 tiles, at least 4 per split
    assert kernels._num_splits(programs=3, tiles=4096, device=gpu) == kernels.MAX_SPLITS
    assert kernels._num_splits(programs=3, tiles=2, device=gpu) == 1
    assert kernels._num_splits(programs=128 * 3, tiles=64, device=gpu) == 1


@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cached_new", [*EXTEND_CASES, *PREFIX_HIT_CASES, [(0, 130)], [(15, 17), (32, 40)]], ids=str)
def test_extend_kernel_matches_reference(attn, kernels, num_kv_heads, group, block_size, cached_new, device):
    """Fresh prompts and sequences with cached tokens (prefix hits, chunks), ragged, GQA, both block sizes."""
    seq_lens, num_new = [c + n for c, n in cached_new], [n for _, n in cached_new]
    q, k_cache, v_cache, tables, _, _ = paged_case(sum(seq_lens) + group, seq_lens, block_size, num_kv_heads, group,
                                                   num_queries=num_new)
    meta = extend_meta(attn, cached_new, tables)
    scale = 1 / math.sqrt(64)
    expected = attn.extend_attention_reference(q, k_cache, v_cache, meta, scale)
    out = run_extend(kernels, device, q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("folder", [folder for folder in STAGES if has(folder, "chunking")], indirect=True)
@pytest.mark.parametrize("num_kv_heads,group", [(3, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("seed", range(3))
def test_the_kernel_runs_random_mixed_steps_as_the_reference_does(attn, kernels, num_kv_heads, group, seed, device):
    """Stage 06's steps through the one extend kernel: decode rows and chunks over their cached context together."""
    cached_new = random_mixed_step(seed * 10 + group)
    seq_lens, num_new = [c + n for c, n in cached_new], [n for _, n in cached_new]
    q, k_cache, v_cache, tables, _, _ = paged_case(seed, seq_lens, 16, num_kv_heads, group, num_queries=num_new)
    meta = extend_meta(attn, cached_new, tables)
    scale = 1 / math.sqrt(64)
    expected = attn.extend_attention_reference(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(run_extend(kernels, device, q, k_cache, v_cache, meta, scale), expected, atol=ATOL,
                               rtol=0)


def test_stage03_gives_the_same_logits_through_either_implementation(monkeypatch, model_dir, device):
    """End to end on the embedded model: a prefill then decode steps across a block edge, both ways."""
    engine = make_engine("03_paged_kv", model_dir, device=device, kv_cache_mb=8)
    prompt = engine.encode("The primary colours are red, yellow and blue. Mixing two of them gives")
    assert 12 <= len(prompt) < 16  # the prefill fills most of block 1; decoding crosses into block 2
    logits: dict[str, torch.Tensor] = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("LLM_ATTENTION", impl)
        table: list[int] = []
        with torch.inference_mode():
            steps = [engine.prefill(prompt, table)[0]]
            for position in range(len(prompt), 18):
                steps.append(engine.decode_one_token(int(steps[-1].argmax()), position, table))
        engine.block_manager.free(table)
        logits[impl] = torch.stack(steps).cpu()
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=ATOL, rtol=0)


def test_stage04_batches_give_the_same_tokens_through_either_implementation(monkeypatch, model_dir, device):
    """A ragged prefill of three prompts, then batched decode steps, with each implementation."""
    engine = make_engine("04_continuous_batching", model_dir, device=device, kv_cache_mb=8)
    params = stage("04_continuous_batching", "sampler").SamplingParams(max_tokens=3, temperature=0.0)
    prompts = [engine.encode(p) for p in ("Hello", "The primary colours are red, yellow and", "def add(a, b):")]
    tokens = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("LLM_ATTENTION", impl)
        tokens[impl] = engine.generate_offline(prompts, params)
    assert tokens["triton"] == tokens["torch"]


# --- any head size, block size and group; bfloat16 -------------------------------------------------------

# Head sizes that are not powers of two (80, 96, 112: padded to 128 inside the kernels), every block
# size the engine offers, and grouped-query attention with 1 to 8 query heads per KV head.
SHAPES = [(64, 16, 1, 1), (80, 32, 2, 3), (128, 64, 1, 4), (96, 128, 1, 7), (112, 16, 1, 8), (80, 128, 2, 8)]


@pytest.mark.parametrize(("head_dim", "block_size", "num_kv_heads", "group"), SHAPES,
                         ids=[f"d{d}-s{s}-kv{k}-g{g}" for d, s, k, g in SHAPES])
def test_kernels_take_any_head_size_block_size_and_group(attn, kernels, head_dim, block_size, num_kv_heads, group,
                                                        device):
    scale = 1 / math.sqrt(head_dim)
    seq_lens = [1, block_size + 1, 150]
    q, k_cache, v_cache, tables, lens, _ = paged_case(head_dim, seq_lens, block_size, num_kv_heads, group,
                                                      head_dim)
    expected = attn.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    out = run_decode(kernels, device, q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)

    cached_new = [(0, 20), (block_size + 3, 5)]
    seq_lens, num_new = [c + n for c, n in cached_new], [n for _, n in cached_new]
    q, k_cache, v_cache, tables, _, _ = paged_case(head_dim + 1, seq_lens, block_size, num_kv_heads, group,
                                                   head_dim, num_queries=num_new)
    meta = extend_meta(attn, cached_new, tables)
    expected = attn.extend_attention_reference(q, k_cache, v_cache, meta, scale)
    out = run_extend(kernels, device, q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


BF16_ATOL = 2e-2  # bfloat16 keeps 8 bits of mantissa: outputs of size ~1 round at about 4e-3, sums more


def test_kernels_in_bfloat16_match_the_float32_reference(attn, kernels, device):
    """CUDA runs bfloat16. The kernels accumulate in float32 whatever the input; compared with the float32
    reference on the same (bfloat16-rounded) inputs, the outputs differ only by bfloat16 rounding."""
    scale = 1 / math.sqrt(64)
    q, k_cache, v_cache, tables, lens, _ = paged_case(5, [7, 40, 130], 16, 2, 3)
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    expected = attn.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    out = run_decode(kernels, device, q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=0)

    cached_new = [(0, 33), (16, 9)]
    q, k_cache, v_cache, tables, _, _ = paged_case(6, [33, 25], 16, 2, 3, num_queries=[33, 9])
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    meta = extend_meta(attn, cached_new, tables)
    expected = attn.extend_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    out = run_extend(kernels, device, q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=0)


def test_the_reference_in_bfloat16_matches_itself_in_float32(attn):
    """On a CPU the reference computes bfloat16 inputs in float32 (PyTorch's CPU kernel is slow on 16-bit inputs
    without native bfloat16 instructions) and hands back bfloat16: only the output's rounding differs."""
    scale = 1 / math.sqrt(64)
    q, k_cache, v_cache, tables, lens, _ = paged_case(5, [7, 40, 130], 16, 2, 3)
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    out = attn.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    expected = attn.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=0)

    cached_new = [(0, 33), (16, 9)]
    q, k_cache, v_cache, tables, _, _ = paged_case(6, [33, 25], 16, 2, 3, num_queries=[33, 9])
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    meta = extend_meta(attn, cached_new, tables)
    out = attn.extend_attention_reference(q, k_cache, v_cache, meta, scale)
    expected = attn.extend_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=0)


@pytest.mark.parametrize("folder", stages_having("static_buffers"))
def test_the_extend_kernels_tuning_is_keyed_on_the_size_of_the_query(folder):
    """A 5-row verification step and an 8,192-token prompt are tuned apart (one tile for both leaves most of a
    verification's BLOCK_M rows idle), and the buckets stay few: every tuning is paid once, at start-up or on the
    first step of its size."""
    kernels = stage(folder, "triton_attention")
    assert "query_rows" in kernels._extend_kernel.keys
    buckets = {kernels.query_rows_bucket(n) for n in range(1, 20_000, 7)}
    assert kernels.query_rows_bucket(5) != kernels.query_rows_bucket(8192) and len(buckets) <= 4
    assert kernels.query_rows_bucket(1) == kernels.query_rows_bucket(5) == kernels.query_rows_bucket(16)
