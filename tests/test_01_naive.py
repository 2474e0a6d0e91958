"""Stage 01: the hand-written prefill/decode loop computes exactly what Hugging Face computes,
and the Flask server answers in the course's and OpenAI's shapes."""

from __future__ import annotations

import httpx
import pytest
import torch

from .conftest import stage

sampler = stage("01_naive", "sampler")
GREEDY_32 = sampler.SamplingParams(max_tokens=32, temperature=0.0)


@pytest.mark.exercise("1.3")
def test_decode_one_token_matches_a_full_forward_pass(engine01):
    prompt_ids = engine01.encode("The history of the Roman Empire")
    next_ids = engine01.tokenizer(" began in Rome", add_special_tokens=False).input_ids
    with torch.inference_mode():
        _, cache = engine01.prefill(prompt_ids)
        for step, token_id in enumerate(next_ids, start=1):
            logits, cache = engine01.decode_one_token(token_id, cache)
            assert cache.get_seq_length() == len(prompt_ids) + step  # one more position per step
            # Without a cache: the whole sequence again, and the logits of its last position.
            full = engine01.model(input_ids=torch.tensor([prompt_ids + next_ids[:step]])).logits[0, -1]
            assert logits.shape == full.shape and torch.allclose(logits, full, atol=1e-4)


@pytest.mark.exercise("1.4")
def test_eos_ends_generation_with_stop(engine01, hf_greedy):
    prompt_ids = engine01.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = engine01.generate(prompt_ids, sampler.SamplingParams(max_tokens=64, temperature=0.0))
    assert result.finish_reason == "stop"
    assert result.output_ids[-1] in engine01.eos_token_ids
    assert result.output_ids == hf_greedy(prompt_ids, 64)  # HF stops at the same EOS
    assert "Paris" in result.text and "<|im_end|>" not in result.text


@pytest.mark.exercise("1.4")
def test_stop_string_cuts_the_text(engine01):
    prompt_ids = engine01.encode("The history of the Roman Empire")
    full = engine01.generate(prompt_ids, GREEDY_32).text
    stopped = engine01.generate(prompt_ids, sampler.SamplingParams(max_tokens=32, temperature=0.0, stop=["Roman"]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index("Roman")]


@pytest.mark.exercise("1.4")
def test_kv_cache_bytes_match_the_model_shape(engine01):
    cfg = engine01.model.config
    prompt_ids = engine01.encode("The history of the Roman Empire")
    result = engine01.generate(prompt_ids, sampler.SamplingParams(max_tokens=8, temperature=0.0))
    # K and V, per layer, per KV head, per head dim, 4 bytes each; the last token is never fed back.
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert result.kv_cache_bytes == per_token * (len(prompt_ids) + 8 - 1)
    assert len(result.output_ids) == 8 and result.finish_reason == "length"


@pytest.mark.exercise("1.4")
def test_seeded_sampling_is_repeatable(engine01):
    prompt_ids = engine01.encode("Once upon a time")
    params = sampler.SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=42)
    first = engine01.generate(prompt_ids, params).output_ids
    assert engine01.generate(prompt_ids, params).output_ids == first


# --- HTTP ---------------------------------------------------------------------------------------


def test_generate_endpoint(server01, engine01, hf_greedy):
    prompt = "The history of the Roman Empire"
    body = httpx.post(f"{server01.url}/generate", json={"prompt": prompt, "max_tokens": 16, "temperature": 0},
                      timeout=60).json()
    expected = hf_greedy(engine01.encode(prompt), 32)[:16]
    assert body["text"] == engine01.tokenizer.decode(expected, skip_special_tokens=True)
    assert body["completion_tokens"] == 16 and body["finish_reason"] == "length"
    assert body["prompt_tokens"] == len(engine01.encode(prompt))
    assert body["prefill_ms"] > 0 and body["decode_ms_per_token"] > 0 and body["kv_cache_bytes"] > 0


def test_openai_completions(server01, engine01, hf_greedy):
    prompt = "def fibonacci(n):"
    completion = server01.client().completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=32, temperature=0)
    prompt_ids = engine01.encode(prompt)
    assert completion.choices[0].text == engine01.tokenizer.decode(hf_greedy(prompt_ids, 32))
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.usage.completion_tokens == 32


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "temperature": -1},
    {"prompt": "hi", "top_p": 1.5},
    {"prompt": "hi", "max_tokens": "ten"},
    {"max_tokens": 4},
    {"prompt": "hi", "model": "gpt-4"},
    {"prompt": "hi", "stream": True},
    {"prompt": "hi " * 9000},
])
def test_bad_input_is_a_400_with_the_error_object(server01, body):
    for path in ("/generate", "/v1/completions"):
        if path == "/generate" and body.get("stream"):
            continue
        response = httpx.post(f"{server01.url}{path}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert httpx.get(f"{server01.url}/health").status_code == 200


def test_malformed_json_and_unknown_routes(server01):
    response = httpx.post(f"{server01.url}/generate", content=b"{not json", timeout=10)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = httpx.get(f"{server01.url}/nope", timeout=10)
    assert response.status_code == 404 and "error" in response.json()
