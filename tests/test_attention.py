"""Paged attention (stage 03 on): the Triton kernels agree with the PyTorch reference, and the
reference agrees with plain dense attention, in every stage that has them (stage 04's decode
reference is batched). Without a GPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import math
import random

import pytest
import torch

from .conftest import stage

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 1e-4


STAGES = ["03_paged_kv", "04_continuous_batching"]


@pytest.fixture(scope="module", params=STAGES)
def folder(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def attn(folder):
    return stage(folder, "attention")


@pytest.fixture(scope="module")
def kernels(folder):
    return stage(folder, "triton_attention")


def graded(exercise: str) -> pytest.MarkDecorator:
    """Run on every stage; stage 03's run grades homework ``exercise``."""
    return pytest.mark.parametrize(
        "folder", [pytest.param(STAGES[0], marks=pytest.mark.exercise(exercise)), *STAGES[1:]], indirect=True)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Textbook softmax(q k^T / sqrt(d)) v for one sequence, written independently of the stage."""
    # q: [Lq, H, D]; k, v: [L, Hkv, D] -> [Lq, H, D]; with causal, query i sees keys 0..i (Lq == L)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_case(seed: int, context_lens: list[int], block_size: int, num_kv_heads: int, group: int,
               head_dim: int = 64):
    """A pool with each sequence's keys scattered over shuffled blocks, plus the dense keys to compare."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks that nobody owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, dense = [], []
    for n, count in zip(context_lens, blocks_per_seq, strict=True):
        table, ids = ids[:count], ids[count:]
        tables.append(table + [0] * (max(blocks_per_seq) - count))
        rows = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        dense.append((k_cache.flatten(0, 1)[rows], v_cache.flatten(0, 1)[rows]))
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, lens, dense


@graded("3.3")
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("context_lens", [[1], [16], [17, 5, 40], [100, 33]])
def test_decode_reference_equals_dense_attention(attn, context_lens, group):
    q, k_cache, v_cache, tables, lens, dense = paged_case(0, context_lens, 16, num_kv_heads=2, group=group)
    out = attn.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale=1 / math.sqrt(64))
    for i, (k, v) in enumerate(dense):
        expected = dense_attention(q[i : i + 1], k, v, causal=False)[0]
        torch.testing.assert_close(out[i], expected, atol=ATOL, rtol=0)


def test_prefill_reference_equals_dense_causal_attention(attn):
    gen = torch.Generator().manual_seed(1)
    lens = [5, 1, 23]
    q = torch.randn(29, 6, 32, generator=gen)
    k, v = torch.randn(29, 2, 32, generator=gen), torch.randn(29, 2, 32, generator=gen)
    cu = torch.tensor([0, 5, 6, 29], dtype=torch.int32)
    out = attn.prefill_attention(q, k, v, cu, scale=1 / math.sqrt(32))
    for start, n in zip([0, 5, 6], lens, strict=True):
        s = slice(start, start + n)
        torch.testing.assert_close(out[s], dense_attention(q[s], k[s], v[s], causal=True), atol=ATOL, rtol=0)


# --- Triton against the reference ------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 3), (3, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_kernel_fills_the_same_slots(attn, kernels, num_kv_heads, group, block_size):
    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, tokens = 6, 37
    k, v = torch.randn(tokens, num_kv_heads, 64, generator=gen), torch.randn(tokens, num_kv_heads, 64, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, 64) for _ in range(4)]
    attn.write_kv(k, v, caches[0], caches[1], slots)
    kernels.write_kv(k.to(DEVICE), v.to(DEVICE), caches[2].to(DEVICE), caches[3].to(DEVICE), slots.to(DEVICE))
    # (on CPU .to() is a no-op, so the kernel wrote into caches[2] and caches[3] themselves)
    if DEVICE == "cpu":
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        assert caches[2].count_nonzero() == tokens * num_kv_heads * 64  # nothing outside the slots


@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("seed", range(3))
def test_decode_kernel_matches_reference(attn, kernels, num_kv_heads, group, block_size, seed):
    rng = random.Random(seed * 100 + block_size + group)
    # Context lengths from 1 to a few hundred: exactly full blocks, partial last blocks, one token.
    context_lens = [rng.choice([1, block_size, block_size + 1, rng.randint(2, 300)]) for _ in range(3)]
    q, k_cache, v_cache, tables, lens, _ = paged_case(seed, context_lens, block_size, num_kv_heads, group)
    scale = 1 / math.sqrt(64)
    expected = attn.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens)]
    out = kernels.decode_attention(*args, scale)
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("lens", [[1], [16], [17, 3, 40], [130]])
def test_prefill_kernel_matches_reference(attn, kernels, num_kv_heads, group, lens):
    gen = torch.Generator().manual_seed(sum(lens) + group)
    total = sum(lens)
    q = torch.randn(total, num_kv_heads * group, 64, generator=gen)
    k, v = torch.randn(total, num_kv_heads, 64, generator=gen), torch.randn(total, num_kv_heads, 64, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(64)
    expected = attn.prefill_attention(q, k, v, cu, scale)
    out = kernels.prefill_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE), max(lens), scale)
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=0)


def test_stage03_gives_the_same_logits_through_either_implementation(monkeypatch, model_dir):
    """End to end on the embedded model: a prefill then decode steps across a block edge, both ways."""
    engine = stage("03_paged_kv", "engine").Engine(model_dir, device=DEVICE, dtype="float32", kv_cache_mb=8)
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


def test_stage04_batches_give_the_same_tokens_through_either_implementation(monkeypatch, model_dir):
    """A ragged prefill of three prompts, then batched decode steps, with each implementation."""
    engine = stage("04_continuous_batching", "engine").Engine(model_dir, device=DEVICE, dtype="float32",
                                                             kv_cache_mb=8)
    params = stage("04_continuous_batching", "sampler").SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [engine.encode(p) for p in ("Hello", "The primary colours are red, yellow and", "def add(a, b):")]
    tokens = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("LLM_ATTENTION", impl)
        tokens[impl] = engine.generate(prompts, params)
    assert tokens["triton"] == tokens["torch"]
