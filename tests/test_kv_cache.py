"""What a KV cache costs (stage 03 on): the bytes of K and V per token, per request, per block of the pool,
and how many requests a memory budget holds."""

from __future__ import annotations

import pytest
import torch

from .conftest import stage
from .stages import changed_stages_with, graded_first

STAGES = changed_stages_with("kv_cache")
GB = 10**9  # as on the box: an "80 GB" card
GiB = 2**30


@pytest.fixture(scope="module", params=STAGES)
def kv(request):
    return stage(request.param, "kv_cache")


def graded(exercise: str) -> pytest.MarkDecorator:
    """Run on every stage; the first (03, which introduces the pool) grades ``exercise``."""
    return pytest.mark.parametrize("kv", graded_first(STAGES, exercise), indirect=True)


BYTES_PER_NUMBER = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float8_e4m3fn: 1, torch.float64: 8}
SHAPES = [  # (layers, KV heads, head dim, tokens)
    (1, 1, 1, 1),
    (30, 3, 64, 1),  # SmolLM2-135M, the course's model: one token
    (30, 3, 64, 16),  # ... one block of 16
    (22, 4, 64, 50),  # TinyLlama, 50 tokens
    (32, 8, 128, 8192),  # Llama-3-8B at 8K
    (80, 8, 128, 32768),  # Llama-2-70B at 32K
    (4, 2, 96, 0),  # nothing cached yet
]


@graded("3.4")
@pytest.mark.parametrize("dtype", list(BYTES_PER_NUMBER), ids=str)
def test_kv_cache_bytes_is_k_and_v_of_every_layer_head_and_dimension(kv, dtype):
    for layers, kv_heads, head_dim, tokens in SHAPES:
        expected = 2 * layers * kv_heads * head_dim * BYTES_PER_NUMBER[dtype] * tokens
        got = kv.kv_cache_bytes(layers, kv_heads, head_dim, tokens, dtype)
        assert got == expected and isinstance(got, int), (layers, kv_heads, head_dim, tokens, dtype)


@graded("3.4")
def test_a_32_layer_model_at_32k_context_in_80_gb(kv):
    """The figures of EXERCISES.md, exercise 3.4: float16, 32 layers, a 32K-token request, 80 GB for the cache."""
    context = 32 * 1024
    # 128 heads of 64 (hidden size 8192), every head with its own K and V: 1 MiB per token.
    per_token = kv.kv_cache_bytes(32, 128, 64, 1, torch.float16)
    assert per_token == 2**20
    assert kv.kv_cache_bytes(32, 128, 64, context, torch.float16) == 32 * GiB
    assert kv.requests_that_fit(80 * GB, 32 * GiB) == 2
    # Llama-2-7B: 32 heads of 128, each its own K and V.
    llama2 = kv.kv_cache_bytes(32, 32, 128, context, torch.float16)
    assert llama2 == 16 * GiB and kv.requests_that_fit(80 * GB, llama2) == 4
    # Llama-3-8B: the same 32 query heads share 8 KV heads (grouped-query attention): a quarter of the cache.
    llama3 = kv.kv_cache_bytes(32, 8, 128, context, torch.bfloat16)
    assert llama3 == 4 * GiB and kv.requests_that_fit(80 * GB, llama3) == 18  # 18.6: no part of a request


@graded("3.4")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pool_is_sized_with_it(kv, dtype):
    """The engine's pool is counted in blocks of ``kv_cache_bytes(..., block_size, ...)``: the same function."""
    shape = kv.CacheShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype=dtype)
    per_block = kv.kv_cache_bytes(3, 2, 8, 16, dtype)
    assert shape.bytes_per_block == per_block and shape.bytes_per_token == kv.kv_cache_bytes(3, 2, 8, 1, dtype)
    budget = 10 * per_block + per_block // 2  # ten blocks and a half: ten
    cache = kv.KVCache.allocate(shape, budget, torch.device("cpu"))
    assert cache.num_blocks == 10 and cache.num_bytes == 10 * per_block
    with pytest.raises(ValueError, match="less than one block"):
        kv.KVCache.allocate(shape, per_block - 1, torch.device("cpu"))
