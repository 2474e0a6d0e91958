"""Stage 05: a prompt whose beginning is in the prefix cache computes only the rest, and still gets exactly
what Hugging Face computes for the whole prompt; the server reports the hit (usage, /metrics, /health);
preemption, abort and a fully cached prompt leave the pool's books balanced."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import cli_help, make_engine, serve_stage, stage

FOLDER = "05_prefix_cache"
sampler = stage(FOLDER, "sampler")
MODEL = "smollm2-135m-instruct"

# About 90 tokens of shared system prompt (chat template included): five whole blocks of 16.
SYSTEM = ("You are a careful assistant for a public library. Answer in one short paragraph. Cite the shelf "
          "section when you recommend a book. Never invent a title; if you do not know, say so. The library "
          "opens at nine and closes at six, except on Sundays, when it is closed. Members may borrow ten books "
          "for three weeks; the fine for a late book is ten cents a day. ")
QUESTIONS = ["Where are the history books?", "Can I renew a book online?", "When are you open on Saturday?",
             "How much is the fine for two late books?"]


def greedy(max_tokens: int, **kwargs):
    return sampler.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def chat(engine, question: str) -> list[int]:
    return engine.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def run_alone(engine, request_id: str, prompt_ids: list[int], params) -> tuple[list[int], int]:
    """Run one request to its end; its tokens and the prompt tokens it found cached."""
    engine.add_request(request_id, prompt_ids, params)
    tokens, cached = [], None
    while engine.has_unfinished():
        for output in engine.step().outputs:
            assert output.error is None, output.error
            tokens += output.token_ids
            cached = output.cached_tokens
    return tokens, cached


def books_balance(engine) -> None:
    """Nothing runs: every block is evictable (findable) or free, and the index holds exactly the evictable ones."""
    blocks = engine.block_manager
    assert blocks.num_used == 0 and not engine.has_unfinished()
    assert blocks.num_evictable + blocks.num_free == blocks.num_blocks
    assert blocks.num_cached == blocks.num_evictable
    assert all(count == 0 for count in blocks.ref_counts)


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(FOLDER, model_dir, kv_cache_mb=64)


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_a_shared_system_prompt_is_computed_once_and_answers_equal_hf(model_dir, hf_greedy, index):
    engine = make_engine(FOLDER, model_dir, kv_cache_mb=64, prefix_cache=index)
    block_size = engine.block_manager.block_size
    first, cached = run_alone(engine, "first", chat(engine, QUESTIONS[0]), greedy(16))
    assert cached == 0  # nothing was cached yet
    for i, question in enumerate(QUESTIONS[1:]):
        prompt_ids = chat(engine, question)
        common = next(k for k, (a, b) in enumerate(zip(prompt_ids, chat(engine, QUESTIONS[0]), strict=False))
                      if a != b)
        tokens, cached = run_alone(engine, f"q{i}", prompt_ids, greedy(16))
        assert cached == common // block_size * block_size >= 64  # every whole block of the shared beginning
        assert tokens == hf_greedy(prompt_ids, 16), question
    assert first == hf_greedy(chat(engine, QUESTIONS[0]), 16)
    books_balance(engine)


def test_the_same_prompt_again_is_all_cached_but_its_last_token(engine, hf_greedy):
    prompt_ids = chat(engine, "What is a library card?")
    expected = hf_greedy(prompt_ids, 12)
    assert run_alone(engine, "once", prompt_ids, greedy(12))[0] == expected
    tokens, cached = run_alone(engine, "twice", prompt_ids, greedy(12))
    # A prompt of exactly whole blocks still computes its last token: that block is recomputed.
    assert cached == (len(prompt_ids) - 1) // engine.block_manager.block_size * engine.block_manager.block_size
    assert tokens == expected
    books_balance(engine)


def test_a_prompt_of_exactly_two_blocks_computes_its_last_block_again(engine):
    block_size = engine.block_manager.block_size
    prompt_ids = chat(engine, "Hello")[: 2 * block_size]
    first, _ = run_alone(engine, "two-blocks", prompt_ids, greedy(4))
    again, cached = run_alone(engine, "two-blocks-again", prompt_ids, greedy(4))
    assert cached == block_size and again == first


def test_a_prompt_shorter_than_one_block_is_never_cached(engine):
    prompt_ids = engine.encode("Hi there")
    assert len(prompt_ids) < engine.block_manager.block_size
    run_alone(engine, "short", prompt_ids, greedy(4))
    assert run_alone(engine, "short-again", prompt_ids, greedy(4))[1] == 0


def test_concurrent_requests_with_one_system_prompt_equal_hf(engine, hf_greedy):
    prompts = [chat(engine, q) for q in QUESTIONS]
    outputs = engine.generate_offline(prompts, greedy(12))
    for prompt_ids, tokens in zip(prompts, outputs, strict=True):
        assert tokens == hf_greedy(prompt_ids, 12)
    books_balance(engine)


def test_a_seeded_sample_is_the_same_hit_or_miss(model_dir, engine):
    params = sampler.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    prompt_ids = chat(engine, "Recommend a novel about the sea.")
    cold = make_engine(FOLDER, model_dir, kv_cache_mb=64, prefix_cache="off")
    miss, _ = run_alone(cold, "miss", prompt_ids, params)
    run_alone(engine, "warm", prompt_ids, greedy(1))  # puts the prompt in the cache
    hit, cached = run_alone(engine, "hit", prompt_ids, params)
    assert cached > 0 and hit == miss


def test_prompt_logprobs_compute_every_position_even_when_cached(engine):
    prompt_ids = chat(engine, "Is there a quiet room?")
    run_alone(engine, "warm-echo", prompt_ids, greedy(1))
    engine.add_request("echo", prompt_ids, greedy(1, prompt_logprobs=0))
    outputs = engine.step().outputs
    assert outputs[0].cached_tokens == 0 and len(outputs[0].prompt_logprobs) == len(prompt_ids) - 1
    books_balance(engine)


def test_abort_during_prefill_releases_every_reference(engine):
    prompt_ids = chat(engine, QUESTIONS[0])
    run_alone(engine, "warm-abort", prompt_ids, greedy(1))
    engine.add_request("sharing", prompt_ids, greedy(50))
    engine.scheduler.schedule()  # admitted: it now shares the cached blocks (their counts are 1)
    assert engine.block_manager.num_used > 0
    engine.abort("sharing")
    books_balance(engine)


def test_preemption_with_shared_blocks_keeps_every_output_exact(model_dir, hf_greedy):
    # A pool of 14 blocks of 16 tokens: four sequences of up to 6 blocks (two of them shared) outgrow it, so the
    # newest are preempted, and readmitted sharing the blocks that the others have cached meanwhile.
    engine = make_engine(FOLDER, model_dir, kv_cache_mb=10)
    assert engine.block_manager.num_blocks == 14
    prompts = [engine.encode(SYSTEM[:200] + q) for q in QUESTIONS]
    outputs = engine.generate_offline(prompts, greedy(40, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for prompt_ids, tokens in zip(prompts, outputs, strict=True):
        assert tokens == hf_greedy(prompt_ids, 40)
    assert engine.scheduler.prefix_cache_hits > 0
    books_balance(engine)


def test_a_small_pool_evicts_the_least_recently_used_blocks_last_block_first(model_dir):
    engine = make_engine(FOLDER, model_dir, kv_cache_mb=9)  # 12 blocks
    blocks = engine.block_manager
    assert blocks.num_blocks == 12
    first, second = (engine.encode(" ".join(f"{topic} {i}" for i in range(36))) for topic in ("apples", "rivers"))
    assert 8 * blocks.block_size < len(first) < 9 * blocks.block_size and len(second) == len(first)
    run_alone(engine, "a", first, greedy(1))
    whole_a = blocks.match(first)
    assert len(whole_a) == 8 and blocks.num_evictable == 8
    run_alone(engine, "b", second, greedy(1))  # 9 blocks, 4 free: 5 of a's are evicted, its last ones first
    assert blocks.match(first) == whole_a[:3]
    assert run_alone(engine, "b-again", second, greedy(1))[1] == 8 * blocks.block_size
    books_balance(engine)


# --- the server --------------------------------------------------------------------------------------


def test_usage_metrics_and_health_report_the_hit(model_dir):
    """The counters move by exactly this test's two requests: a server of its own, whose engine no other test
    steps directly (the session's engine05 is also driven offline by tests over every stage)."""
    with serve_stage(FOLDER, make_engine(FOLDER, model_dir, kv_cache_mb=64)) as server:
        client = server.client()
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you lend e-books?"}]
        queries, hits = (server.metric(f"llm_prefix_cache_{name}_total") for name in ("queries", "hits"))
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= 64
        assert second.choices[0].message.content == first.choices[0].message.content
        assert server.metric("llm_prefix_cache_queries_total") - queries == 2 * second.usage.prompt_tokens
        gained = server.metric("llm_prefix_cache_hits_total") - hits
        assert gained == (first.usage.prompt_tokens_details.cached_tokens
                          + second.usage.prompt_tokens_details.cached_tokens)
        assert server.metric("llm_kv_blocks_cached") > 0
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        assert 0 < health["prefix_cache_hit_rate"] <= 1 and health["kv_blocks"]["cached"] > 0


def test_streamed_usage_reports_cached_tokens_too(server05):
    client = server05.client()
    prompt = SYSTEM + "Question: can children join?"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_concurrent_clients_sharing_a_prompt_all_complete(server05):
    client = server05.client()

    def ask(i: int) -> str:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % 4]}]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for i, answer in enumerate(answers):
        assert answer.choices[0].message.content == answers[i % 4].choices[0].message.content


def test_cli_help_names_the_prefix_cache_flag():
    out = cli_help(FOLDER)
    assert "--prefix-cache {hash,radix,off}" in out


# --- n > 1: the samples of one prompt share its blocks ---------------------------------------------


def test_n_samples_prefill_the_prompt_once_and_share_its_blocks(engine):
    prompt_ids = engine.encode("Names for the library's cat, which sleeps on the returns desk every afternoon and "
                               "greets readers at the door each morning, purring at the children and ignoring "
                               "the adults who come for the newspapers: ")  # shares nothing with other tests
    block_size = engine.block_manager.block_size
    assert len(prompt_ids) > 2 * block_size
    engine.add_request("four", prompt_ids, sampler.SamplingParams(max_tokens=6, temperature=0.9, seed=3), n=4)
    first = engine.step().outputs  # sample 0's prefill alone: its blocks are indexed, then the others are queued
    assert [output.index for output in first] == [0] and first[0].cached_tokens == 0
    second = engine.step().outputs  # the other three prefill only what is not in whole cached blocks
    assert sorted(output.index for output in second) == [1, 2, 3]
    assert {output.cached_tokens for output in second} == {(len(prompt_ids) - 1) // block_size * block_size}
    shared = engine.scheduler.sequences["four"][0].block_table[:(len(prompt_ids) - 1) // block_size]
    assert all(engine.block_manager.ref_counts[block] == 4 for block in shared)
    while engine.has_unfinished():
        engine.step()
    books_balance(engine)


def test_seeded_samples_differ_from_each_other_and_repeat_exactly(server05):
    client = server05.client()
    kwargs = dict(model=MODEL, prompt=SYSTEM + "Name a good book.", max_tokens=12, temperature=1.0, seed=11)
    once = client.completions.create(n=4, **kwargs)
    again = client.completions.create(n=4, **kwargs)
    alone = client.completions.create(n=1, **kwargs)
    texts = [choice.text for choice in sorted(once.choices, key=lambda choice: choice.index)]
    assert [choice.index for choice in sorted(once.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert texts == [choice.text for choice in sorted(again.choices, key=lambda choice: choice.index)]
    assert len(set(texts)) > 1  # four samples, not one answer four times
    assert texts[0] == alone.choices[0].text  # sample 0 draws what n = 1 draws
    assert once.usage.completion_tokens == 4 * 12 and once.usage.prompt_tokens == alone.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_greedy_chat_choices_all_equal_hf(server05, engine05, hf_greedy, stream):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokens = hf_greedy(engine05.encode_chat(messages), 8)
    expected = engine05.tokenizer.decode(tokens, skip_special_tokens=True)
    response = server05.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                         temperature=0, n=3, stream=stream,
                                                         **({"stream_options": {"include_usage": True}} if stream
                                                            else {}))
    texts = {0: "", 1: "", 2: ""}
    if stream:
        chunks = list(response)
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        usage = chunks[-1].usage
    else:
        texts = {choice.index: choice.message.content for choice in response.choices}
        usage = response.usage
    assert list(texts.values()) == [expected] * 3
    assert usage.completion_tokens == 3 * len(tokens)  # every choice's tokens, its EOS included


def test_echo_with_n_above_one_is_a_400(server05):
    response = httpx.post(f"{server05.url}/v1/completions", json={"prompt": "hi", "n": 2, "echo": True,
                                                                  "max_tokens": 2}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
