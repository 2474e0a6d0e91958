"""Stage 03: on its own model and a paged KV cache, the server still computes exactly what Hugging Face
computes; the pool is sized from the budget, every finished or abandoned request gives its blocks back,
and a request that could never fit the pool gets a clear 400."""

from __future__ import annotations

import httpx
import pytest
import torch

from .conftest import cli_help, make_engine, stage
from .prompts import TEXT_PROMPTS

sampler = stage("03_paged_kv", "sampler")
MODEL = "smollm2-135m-instruct"


def greedy(max_tokens: int, **kwargs) -> object:
    return sampler.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def token_ids(engine, prompt_ids: list[int], params) -> list[int]:
    return [t for output in engine.generate("test", prompt_ids, params) for t in output.token_ids]


# --- the same tokens as Hugging Face and as stage 02 -----------------------------------------------


def test_seeded_sampling_repeats(engine03):
    prompt_ids = engine03.encode("Once upon a time")
    params = sampler.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    assert token_ids(engine03, prompt_ids, params) == token_ids(engine03, prompt_ids, params)


# --- the pool and its blocks ------------------------------------------------------------------------


@pytest.mark.exercise("3.4")
def test_pool_is_sized_from_the_budget(engine03):
    cache, blocks = engine03.kv_cache, engine03.block_manager
    config = engine03.model.config
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K and V x 4 bytes = 46,080 bytes per token.
    assert cache.shape.bytes_per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    kv_cache_bytes = stage("03_paged_kv", "kv_cache").kv_cache_bytes  # exercise 3.4: what a block of 16 costs
    assert cache.shape.bytes_per_block == kv_cache_bytes(config.num_layers, config.num_kv_heads, config.head_dim, 16,
                                                         torch.float32)
    assert cache.num_blocks == 64 * 2**20 // cache.shape.bytes_per_block == blocks.num_blocks
    assert cache.num_bytes <= 64 * 2**20
    assert engine03.kv_capacity_tokens == blocks.num_blocks * 16


def test_a_sequence_holds_blocks_as_it_grows_and_returns_them(engine03):
    blocks = engine03.block_manager
    prompt_ids = engine03.encode("The history of the Roman Empire")  # a few tokens: one block
    held = []
    for output in engine03.generate("grow", prompt_ids, greedy(40, ignore_eos=True)):
        held.append(blocks.num_used)
        tokens_in_cache = len(prompt_ids) + output.completion_tokens - 1  # the newest token is not run yet
        assert blocks.num_used == blocks.blocks_needed(tokens_in_cache)
    assert held[0] < held[-1]  # it took more blocks as it grew, one at a time
    assert blocks.num_used == 0  # finished: everything back


def test_a_consumer_that_leaves_early_returns_the_blocks(engine03):
    blocks = engine03.block_manager
    outputs = engine03.generate("leave", engine03.encode("Count: 1, 2, 3,"), greedy(500, ignore_eos=True))
    for _ in range(20):
        next(outputs)
    assert blocks.num_used > 0
    outputs.close()
    assert blocks.num_used == 0


# --- the server ---------------------------------------------------------------------------------------


def test_health_and_metrics_report_the_blocks(server03, engine03):
    health = httpx.get(f"{server03.url}/health").json()
    assert health["kv_blocks"] == {"total": engine03.block_manager.num_blocks, "used": 0,
                                   "free": engine03.block_manager.num_blocks, "block_size": 16}
    assert server03.metric("llm_kv_blocks_used") == 0
    assert server03.metric("llm_kv_blocks_free") == engine03.block_manager.num_blocks


def test_a_request_that_can_never_fit_is_a_400(server03, engine03):
    capacity = engine03.kv_capacity_tokens
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": capacity, "stream": True}
    response = httpx.post(f"{server03.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "kv_cache_too_small" and error["param"] == "max_tokens"
    assert str(capacity) in error["message"]
    # The server is unharmed, and a request without max_tokens is capped by the pool, not refused.
    client = server03.client()
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).usage.completion_tokens == 3


def test_http_greedy_equals_hf(server03, engine03, hf_greedy):
    prompt = TEXT_PROMPTS[0]
    chunks = server03.client().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                  stream=True)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine03.tokenizer.decode(hf_greedy(engine03.encode(prompt), 16))


def test_cli_help_names_the_pool_flags():
    out = cli_help("03_paged_kv")
    assert "--kv-cache-mb" in out and "--block-size" in out and "--demo" in out


def test_the_start_up_warm_up_writes_nothing_into_the_pool(model_dir):
    """The engine compiles its kernels at start-up with a decode and an extend step whose K/V go to slot
    -1, which is nowhere: the pool must still hold only the zeros it was allocated with."""
    engine = make_engine("03_paged_kv", model_dir, kv_cache_mb=4)
    assert engine.kv_cache.data.count_nonzero() == 0
    engine.warm_up()
    assert engine.kv_cache.data.count_nonzero() == 0 and engine.block_manager.num_used == 0
