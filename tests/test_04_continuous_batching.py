"""Stage 04: many requests share every forward pass, and each still gets exactly what Hugging Face
computes for it alone, with or without preemption; seeded sampling does not depend on the batch;
the server serves many clients at once and frees what a disconnected one held."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import cli_help, make_engine, stage
from .prompts import CHAT_PROMPTS, TEXT_PROMPTS

sampler = stage("04_continuous_batching", "sampler")
runner_module = stage("04_continuous_batching", "model_runner")
MODEL = "smollm2-135m-instruct"

# 16 prompts of mixed lengths (3 to about 60 tokens): ragged prefills, and decodes that end at different steps.
MIXED_PROMPTS = [
    *TEXT_PROMPTS,
    "Hello",
    "Once upon a time, in a small village at the foot of the mountains, there lived an old clockmaker who",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n\ndef softmax(x):",
    "The three laws of thermodynamics are",
    "Dear hiring manager, I am writing to apply for the position of",
    "La capitale de la France est",
    "Here is a list of prime numbers: 2, 3, 5, 7,",
    "In 1969, Neil Armstrong",
    "SELECT name, age FROM users WHERE",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "Photosynthesis is the process by which plants",
]


def greedy(max_tokens: int, **kwargs):
    return sampler.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


@pytest.fixture(scope="module")
def mixed(engine04, hf_greedy) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, Hugging Face's greedy 24 tokens for that prompt alone) for the 16 prompts."""
    assert len(MIXED_PROMPTS) == 16
    return [(ids, hf_greedy(ids, 24)) for ids in map(engine04.encode, MIXED_PROMPTS)]


def test_a_batch_of_16_mixed_prompts_equals_hf_on_each_alone(engine04, mixed):
    outputs = engine04.generate_offline([ids for ids, _ in mixed], greedy(24))
    for (ids, expected), ours in zip(mixed, outputs, strict=True):
        assert ours == expected, engine04.tokenizer.decode(ids)
    assert engine04.block_manager.num_used == 0 and not engine04.has_unfinished()


def test_requests_that_join_mid_way_still_equal_hf(engine04, mixed):
    """Arrivals at different steps: each joins the running batch at the next step."""
    outputs: dict[str, list[int]] = {}
    batch_sizes = []
    for step in range(200):
        if step % 3 == 0 and step // 3 < 8:
            i = step // 3
            engine04.add_request(f"late-{i}", mixed[i][0], greedy(24))
            outputs[f"late-{i}"] = []
        if not engine04.has_unfinished():
            break
        step_outputs = engine04.step().outputs
        batch_sizes.append(len(step_outputs))
        for output in step_outputs:
            outputs[output.request_id].extend(output.token_ids)
    assert [outputs[f"late-{i}"] for i in range(8)] == [expected for _, expected in mixed[:8]]
    assert max(batch_sizes) > 4  # they really ran together


def test_preemption_by_recomputation_keeps_every_output_exact(model_dir, mixed):
    """A pool of 7 blocks (112 tokens) for 8 sequences of up to 3 blocks each: some must be preempted."""
    engine = make_engine("04_continuous_batching", model_dir, kv_cache_mb=5)
    assert engine.block_manager.num_blocks == 7
    prompts = [(ids, expected) for ids, expected in mixed if len(ids) + 24 <= 48][:8]
    assert len(prompts) == 8
    outputs = engine.generate_offline([ids for ids, _ in prompts], greedy(24))
    assert engine.scheduler.num_preemptions > 0
    assert outputs == [expected for _, expected in prompts]
    assert engine.block_manager.num_used == 0


def test_a_seeded_request_gives_the_same_text_whatever_its_batch(engine04):
    prompt = engine04.encode("Once upon a time")
    params = sampler.SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    alone = engine04.generate_offline([prompt], params)[0]
    others = [sampler.SamplingParams(max_tokens=n, temperature=1.0, seed=None) for n in (4, 20, 9)]
    batch = [engine04.encode(p) for p in TEXT_PROMPTS[:3]] + [prompt]
    in_batch = engine04.generate_offline(batch, [*others, params])[-1]
    assert in_batch == alone
    other_seed = sampler.SamplingParams(max_tokens=16, temperature=0.8, seed=8)
    assert engine04.generate_offline([prompt], other_seed)[0] != alone


# --- the end of a sequence: EOS, max_tokens, stop strings (exercise 4.4) ------------------------------

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]  # greedy: a short answer, then EOS
ROME = "The history of the Roman Empire"  # greedy: no EOS in 32 tokens, and "Roman" comes back


def run_one(engine, request_id: str, prompt_ids: list[int], params) -> list:
    """Run one request to its end through ``engine.step()``; its outputs, one per step."""
    engine.add_request(request_id, prompt_ids, params)
    outputs = []
    for _ in range(params.max_tokens + 2):  # a bound: a sequence that never finishes fails here, not forever
        for output in engine.step().outputs:
            assert output.error is None, repr(output.error)
            outputs.append(output)
        if not engine.has_unfinished():
            break
    assert outputs and outputs[-1].finished, "the sequence did not finish"
    # It left; its blocks are back.
    assert request_id not in engine.scheduler.sequences and engine.block_manager.num_used == 0
    return outputs


def ids_of(outputs) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


def text_of(outputs) -> str:
    return "".join(output.text for output in outputs)


def assert_one_token_per_step_then(outputs, finish_reason: str) -> None:
    assert [len(o.token_ids) for o in outputs] == [1] * len(outputs)
    assert [o.completion_tokens for o in outputs] == list(range(1, len(outputs) + 1))
    assert [o.finish_reason for o in outputs] == [None] * (len(outputs) - 1) + [finish_reason]


@pytest.mark.exercise("4.4")
def test_eos_ends_a_sequence_with_stop_counted_but_not_shown(engine04, hf_greedy):
    prompt_ids = engine04.encode_chat(FRANCE)
    outputs = run_one(engine04, "eos", prompt_ids, greedy(64))
    ids = ids_of(outputs)
    assert ids == hf_greedy(prompt_ids, 64) and ids[-1] in engine04.eos_token_ids  # HF stops at the same EOS
    assert_one_token_per_step_then(outputs, "stop")
    text = text_of(outputs)
    assert text == engine04.tokenizer.decode(ids, skip_special_tokens=True)
    assert "Paris" in text and "<|im_end|>" not in text


@pytest.mark.exercise("4.4")
def test_ignore_eos_runs_past_the_eos_to_max_tokens(engine04, hf_greedy):
    prompt_ids = engine04.encode_chat(FRANCE)
    until_eos = hf_greedy(prompt_ids, 64)
    outputs = run_one(engine04, "ignore-eos", prompt_ids, greedy(len(until_eos) + 4, ignore_eos=True))
    ids = ids_of(outputs)
    assert len(ids) == len(until_eos) + 4 and ids[: len(until_eos)] == until_eos  # the EOS, then 4 more
    assert_one_token_per_step_then(outputs, "length")
    assert text_of(outputs) == engine04.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.exercise("4.4")
def test_max_tokens_ends_a_sequence_with_length(engine04, hf_greedy):
    prompt_ids = engine04.encode(ROME)
    outputs = run_one(engine04, "length", prompt_ids, greedy(8))
    ids = ids_of(outputs)
    assert ids == hf_greedy(prompt_ids, 32)[:8]
    assert_one_token_per_step_then(outputs, "length")
    assert text_of(outputs) == engine04.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.exercise("4.4")
def test_a_stop_string_ends_with_stop_and_the_text_is_cut_before_it(engine04):
    prompt_ids = engine04.encode(ROME)
    full = text_of(run_one(engine04, "full", prompt_ids, greedy(32)))
    assert "Roman" in full
    outputs = run_one(engine04, "stop-string", prompt_ids, greedy(32, stop=["Roman"]))
    assert_one_token_per_step_then(outputs, "stop")
    assert len(outputs) < 32
    assert text_of(outputs) == full[: full.index("Roman")]


@pytest.mark.exercise("4.4")
def test_text_held_back_for_a_stop_string_is_sent_when_max_tokens_ends_the_sequence(engine04):
    """The last characters may be the start of a stop string that never comes: at the end they are text."""
    prompt_ids = engine04.encode(ROME)
    full = text_of(run_one(engine04, "full", prompt_ids, greedy(8)))
    tail = full[-3:]
    outputs = run_one(engine04, "held-back", prompt_ids, greedy(8, stop=[tail + "\u00a7\u00a7"]))
    assert_one_token_per_step_then(outputs, "length")
    assert text_of(outputs) == full and outputs[-1].text.endswith(tail)


@pytest.mark.exercise("4.4")
def test_a_finished_sequence_frees_its_blocks_while_the_others_run_on(engine04):
    blocks = engine04.block_manager
    engine04.add_request("short", engine04.encode(ROME), greedy(2, ignore_eos=True))
    engine04.add_request("long", engine04.encode("Count: 1, 2, 3,"), greedy(12, ignore_eos=True))
    short, long = engine04.scheduler.sequences["short"], engine04.scheduler.sequences["long"]
    finished = {}
    for _ in range(20):
        for output in engine04.step().outputs:
            assert output.error is None, repr(output.error)
            if output.finished:
                finished[output.request_id] = output
        if "short" in finished:
            break
    assert finished["short"].finish_reason == "length" and finished["short"].completion_tokens == 2
    assert "short" not in engine04.scheduler.sequences and short.block_table == []
    assert "long" not in finished and blocks.num_used == len(long.block_table) > 0  # only the long one holds blocks
    while engine04.has_unfinished():
        engine04.step()
    assert blocks.num_used == 0 and len(long.output_ids) == 12


def test_abort_frees_the_blocks_at_once(engine04):
    engine04.add_request("gone", engine04.encode("Count: 1, 2, 3,"), greedy(500, ignore_eos=True))
    for _ in range(5):
        engine04.step()
    assert engine04.block_manager.num_used > 0
    engine04.abort("gone")
    assert engine04.block_manager.num_used == 0 and not engine04.has_unfinished()


def test_a_request_larger_than_the_pool_is_refused(engine04):
    with pytest.raises(ValueError, match="exceed"):
        engine04.add_request("huge", [1, 2, 3], greedy(engine04.kv_capacity_tokens))
    assert not engine04.has_unfinished()


# --- the batched sampler ------------------------------------------------------------------------------


def test_batched_probs_equal_stage03_row_by_row():
    import torch

    old = stage("03_paged_kv", "sampler")
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.8), dict(temperature=1.3),
            dict(temperature=0.5, top_k=10, top_p=0.5), dict(top_p=5e-324), dict(temperature=1e-5, top_k=2**70)]
    batched = sampler.logits_to_probs(logits, [sampler.SamplingParams(**row) for row in rows])
    for i, row in enumerate(rows):
        torch.testing.assert_close(batched[i], old.logits_to_probs(logits[i], old.SamplingParams(**row)))


def test_batched_sampling_follows_the_distribution():
    import torch

    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(2, 4)
    params = [sampler.SamplingParams(temperature=1.0), sampler.SamplingParams(temperature=0.0)]
    generators = [sampler.make_generator(i) for i in range(2)]
    counts = torch.zeros(4)
    for _ in range(2000):
        first, second = sampler.sample(logits, params, generators)
        counts[first] += 1
        assert second == 0  # the greedy row
    assert counts[3] == 0
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.04, rtol=0)


# --- the server ---------------------------------------------------------------------------------------


def test_many_concurrent_clients_all_complete(server04):
    client = server04.client()

    def one(i: int) -> tuple[str, int]:
        response = client.completions.create(model=MODEL, prompt=MIXED_PROMPTS[i % 16], max_tokens=8 + i % 5,
                                             temperature=0, extra_body={"ignore_eos": True})
        return response.choices[0].finish_reason, response.usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert results == [("length", 8 + i % 5) for i in range(32)]
    assert server04.metric("llm_kv_blocks_used") == 0


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_http_chat_greedy_equals_hf(server04, engine04, hf_greedy, prompt):
    response = server04.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
    expected = hf_greedy(engine04.encode_chat([{"role": "user", "content": prompt}]), 16)
    assert response.choices[0].message.content == engine04.tokenizer.decode(expected, skip_special_tokens=True)


def test_health_and_metrics(server04, engine04):
    assert server04.wait_idle()
    health = httpx.get(f"{server04.url}/health").json()
    assert health["running"] == 0 and health["waiting"] == 0
    assert health["kv_blocks"]["used"] == 0 and health["kv_blocks"]["total"] == engine04.block_manager.num_blocks
    assert server04.metric("llm_preemptions_total") == 0
    assert server04.metric("llm_requests_running") == 0


def test_a_request_that_can_never_fit_is_a_400(server04, engine04):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": engine04.kv_capacity_tokens}
    response = httpx.post(f"{server04.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "kv_cache_too_small"


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
def test_cli_help_names_the_batching_flags():
    out = cli_help("04_continuous_batching")
    assert "--max-num-seqs" in out and "--max-num-batched-tokens" in out and "--demo" in out


def test_the_start_up_warm_up_writes_nothing_into_the_pool(model_dir):
    """At start-up the engine runs a decode step and an extend step to compile its kernels (on CUDA it
    first runs its largest step, to measure the activations before sizing the pool). Those steps write
    K/V to slot -1, which is nowhere: the pool must still hold only the zeros it was allocated with."""
    engine = make_engine("04_continuous_batching", model_dir, kv_cache_mb=4)
    assert engine.kv_cache.data.count_nonzero() == 0
    runner_module.run_dummy_step(engine.model, engine.kv_cache, engine.device, 40)  # 3 blocks, all read from block 0
    assert engine.kv_cache.data.count_nonzero() == 0
