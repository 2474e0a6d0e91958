"""What only a GPU can show (all marked ``cuda``; skipped, saying so, on a machine without one).

The kernels' agreement with the reference and every stage's agreement with Hugging Face run on the GPU
too, as the ``cuda`` cases of ``test_attention.py`` and ``test_all_stages.py``. Here: a pool too large
for 32-bit offsets, no kernel compiled after start-up, the pool sized from the card's memory, and one rank
in a NCCL group."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from .conftest import make_engine, stage
from .stages import changed_stages_with, has
from .steps import verification_step
from .test_attention import BF16_ATOL, extend_meta

pytestmark = pytest.mark.cuda

KERNEL_STAGES = changed_stages_with("triton_attention", "attention")


def release_cuda_memory() -> None:
    """Free what earlier tests left, and forget their peak: an engine sizes its pool by the activations'
    peak in this process (``budget_bytes``), and a test's 8 GiB pool is no activation of the next engine."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


@pytest.mark.parametrize("folder", KERNEL_STAGES)
def test_a_pool_past_2_to_the_31_numbers_is_read_and_written_at_the_right_places(folder):
    """A bfloat16 pool of 2**31 + numbers (4 GiB per K or V): a sequence whose blocks sit at its far end. With
    32-bit offsets, block * stride would wrap around and land at the pool's start."""
    attn, kernels = stage(folder, "attention"), stage(folder, "triton_attention")
    block_size, num_kv_heads, head_dim, group = 16, 8, 128, 4
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 8
    k_cache, v_cache = (torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16,
                                    device="cuda") for _ in range(2))
    owned = [num_blocks - 1, num_blocks - 7, 2, num_blocks - 2]  # mostly past the 2**31st number
    seq_len = len(owned) * block_size - 3
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, device="cuda").bfloat16() for _ in range(2))
    slots = torch.tensor([owned[p // block_size] * block_size + p % block_size for p in range(seq_len)],
                         device="cuda")
    kernels.write_kv(k, v, k_cache, v_cache, slots)
    for cache, new in ((k_cache, k), (v_cache, v)):
        assert torch.equal(cache[owned].flatten(0, 1)[:seq_len], new)
    assert k_cache.count_nonzero() == k.count_nonzero(), "a key landed outside its slot (a wrapped offset?)"

    # The reference reads a copy of just the owned blocks, renumbered 0..3, in float32.
    small_k, small_v = k_cache[owned].float(), v_cache[owned].float()
    table = torch.tensor([owned], dtype=torch.int32, device="cuda")
    small_table = torch.arange(len(owned), dtype=torch.int32, device="cuda")[None]
    lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(head_dim)
    q = torch.randn(1, num_kv_heads * group, head_dim, generator=gen, device="cuda").bfloat16()
    expected = attn.decode_attention_reference(q.float(), small_k, small_v, small_table, lens, scale)
    out = kernels.decode_attention(q, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=0)

    q = torch.randn(seq_len, num_kv_heads * group, head_dim, generator=gen, device="cuda").bfloat16()
    meta = extend_meta(attn, [(0, seq_len)], small_table)
    meta.query_start_loc, meta.seq_lens = meta.query_start_loc.cuda(), meta.seq_lens.cuda()
    expected = attn.extend_attention_reference(q.float(), small_k, small_v, meta, scale)
    out = kernels.extend_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, table, seq_len, scale)
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=0)
    del k_cache, v_cache
    release_cuda_memory()


@pytest.mark.parametrize("folder", KERNEL_STAGES)
def test_serving_compiles_no_kernel_after_start_up(folder, model_dir):
    """The start-up's warm-up compiles (and tunes) every kernel. Serving then changes the batch, the prompt
    lengths, the block table's width and the decode's number of splits from step to step: none of that may
    make Triton compile a new variant while users wait."""
    knobs = getattr(__import__("triton"), "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compilation hook (triton.knobs.runtime.jit_post_compile_hook, 3.4+)")
    engine = make_engine(folder, model_dir, device="cuda", dtype="bfloat16", kv_cache_mb=512)
    compiled: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        params = stage(folder, "sampler").SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompts = [[1 + i % 1000 for i in range(n)] for n in (3, 17, 70, 333, 1200)]  # 1 to 80 blocks
        if has(folder, "batching"):  # 04 on: one continuous batch
            engine.generate_offline(prompts, params)
        else:
            for i, ids in enumerate(prompts):
                list(engine.generate(f"r{i}", ids, params))
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert compiled == [], f"compiled while serving: {compiled}"
    del engine
    release_cuda_memory()


def test_the_pool_takes_what_the_card_has_left_by_nano_vllms_rule(model_dir):
    """kv_cache_mb=0 on CUDA: total x utilization - what is in use - the largest step's activations. The pool
    is large (the 135M model's weights take well under 1 GiB) and the card stays under the utilization."""
    release_cuda_memory()
    engine = make_engine("04_continuous_batching", model_dir, device="cuda", gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    pool = engine.kv_cache.data.numel() * engine.kv_cache.data.element_size()
    assert pool > 0.3 * total, f"a pool of {pool / 2**30:.1f} GiB on a {total / 2**30:.0f} GiB card"
    assert total - free <= 0.5 * total + 256 * 2**20, "the card is fuller than the utilization allows"
    del engine
    release_cuda_memory()
    engine = make_engine("04_continuous_batching", model_dir, device="cuda", kv_cache_mb=64)  # honoured as given
    assert engine.kv_cache.num_blocks == 64 * 2**20 // engine.kv_cache.shape.bytes_per_block
    del engine
    release_cuda_memory()


def test_one_rank_in_an_nccl_group_gives_the_tokens_of_an_engine_without_one(model_dir):
    """Without a process group one rank issues no collective; with ``process_group`` every all-reduce, gather and
    broadcast goes through NCCL, the all-reduces inside the captured graphs too: the path N > 1 takes on GPUs, run
    on one. Its tokens are those of the engine without a group (a sum over one rank is its one part)."""
    folder = "09_tensor_parallel"
    params = stage(folder, "sampler").SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (7 * i) % 1000 for i in range(n)] for n in (5, 40, 130)]
    release_cuda_memory()
    plain = make_engine(folder, model_dir, device="cuda", kv_cache_mb=256, speculative="off")
    expected = plain.generate_offline(prompts, params)
    plain.shutdown()
    del plain
    release_cuda_memory()
    engine = make_engine(folder, model_dir, device="cuda", kv_cache_mb=256, speculative="off", process_group=True)
    try:
        assert torch.distributed.get_backend(engine.tp.group) == "nccl"
        assert engine.runner.graphs, "the decode steps were captured, their all-reduces with them"
        assert engine.generate_offline(prompts, params) == expected
    finally:
        engine.shutdown()
    assert not torch.distributed.is_initialized()
    del engine
    release_cuda_memory()


def test_verification_buckets_and_the_drafts_buckets_are_captured_and_replay_as_eager(model_dir):
    """On CUDA every bucket is captured, decode and verification, the draft runner's too; a step with guesses
    replays its verification bucket's graph and gives the eager step's logits (bfloat16), padding rows finite."""
    folder = "08_speculative"
    runner_module = stage(folder, "model_runner")
    release_cuda_memory()
    engine = make_engine(folder, model_dir, device="cuda", dtype="bfloat16", kv_cache_mb=64, max_num_seqs=8,
                         speculative="ngram", num_speculative_tokens=4, speculative_policy="always")
    runner = engine.runner
    assert set(runner.graphs) == set(runner.buckets) and runner_module.Bucket(16, 5) in runner.graphs
    step = verification_step(runner_module, [(37, 2, [1, 2, 3]), (16, 0, [4, 5]), (5, 1, [6]),
                                             (80, 4, [7, 8, 9, 10, 11, 12])])
    replayed, _ = runner.execute(step)
    assert torch.isfinite(runner.buffers.hidden[:16]).all(), "padding rows too"
    eager, _ = runner.run_eager(step)
    torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
    del engine, runner
    release_cuda_memory()
    drafting = make_engine(folder, model_dir, device="cuda", dtype="bfloat16", kv_cache_mb=64, max_num_seqs=8,
                           speculative="draft", draft_layers=2, num_speculative_tokens=2, speculative_policy="always")
    draft_runner = drafting.proposer.runner
    assert set(draft_runner.graphs) == set(draft_runner.buckets) == {(size, 1) for size in draft_runner.sizes}
    del drafting, draft_runner
    release_cuda_memory()
