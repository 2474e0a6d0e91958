"""Stage 06: each step has a token budget, spent on decodes first and then on prompt chunks, and one forward
pass runs both. A prompt computed chunk by chunk gives exactly what Hugging Face gives for the whole prompt;
the scheduler never exceeds the budget, never skips a decode, serves prompts first come first served, and
starves nobody; the chunk's attention over its cached context is causal attention over the whole sequence."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from . import scheduling
from .conftest import REPO, cli_help, make_engine, stage
from .scheduling import SilentDetokenizer
from .test_05_prefix_cache import books_balance, chat  # the library's system prompt, and a pool at rest
from .test_attention import dense_attention, extend_meta, paged_case

FOLDER = "06_chunked_prefill"
scheduler_module = stage(FOLDER, "scheduler")
sequence = stage(FOLDER, "sequence")
block_manager = stage(FOLDER, "block_manager")
sampler = stage(FOLDER, "sampler")
model_runner = stage(FOLDER, "model_runner")
attention = stage(FOLDER, "attention")

# --- the scheduler, without a model ------------------------------------------------------------------


def seq(name: str, prompt_len: int, max_tokens: int = 1000):
    """A sequence the scheduler can handle; it never samples or detokenizes, so those are left out."""
    params = sampler.SamplingParams(max_tokens=max_tokens)
    return sequence.Sequence(name, list(range(prompt_len)), params, generator=None, detokenizer=SilentDetokenizer())


def make(num_blocks: int = 100, max_num_seqs: int = 4, budget: int = 16):
    blocks = block_manager.BlockManager(num_blocks, block_size=16)
    return scheduler_module.Scheduler(blocks, max_num_seqs, budget, eos_token_ids=set()), blocks


def run(scheduler, batch) -> list[str]:
    """The step has run: ``launched`` and ``postprocess`` give a token (0) to every sequence whose step reaches its
    last token. Returns who sampled."""
    return scheduling.run(scheduler, scheduler_module, batch)


def scheduled(batch) -> list[tuple[str, int]]:
    """Who runs in the step, and how many tokens each."""
    return [(s.request_id, s.num_scheduled_tokens) for s in batch.seqs]


@pytest.mark.exercise("6.1")
def test_decodes_first_then_the_rest_of_the_budget_goes_to_a_long_prompt_in_chunks():
    scheduler, _ = make(budget=16)
    scheduler.add(seq("chat", 5))
    assert run(scheduler, scheduler.schedule()) == ["chat"]  # its whole prompt in one step
    scheduler.add(seq("long", 40))
    steps = []
    for _ in range(4):
        batch = scheduler.schedule()
        steps.append((scheduled(batch), run(scheduler, batch)))
    assert steps == [
        ([("chat", 1), ("long", 15)], ["chat"]),  # a chunk of 15: no token for "long" yet
        ([("chat", 1), ("long", 15)], ["chat"]),
        ([("chat", 1), ("long", 10)], ["chat", "long"]),  # its last chunk samples its first token
        ([("chat", 1), ("long", 1)], ["chat", "long"]),  # now both decode
    ]


@pytest.mark.exercise("6.1")
def test_a_running_prompt_gets_its_chunk_before_a_new_one_is_admitted():
    scheduler, _ = make(budget=16)
    scheduler.add(seq("first", 20))
    scheduler.add(seq("second", 20))
    batch = scheduler.schedule()
    assert scheduled(batch) == [("first", 16)]  # "second" waits: the budget is spent
    assert [s.request_id for s in scheduler.waiting] == ["second"]
    run(scheduler, batch)
    assert scheduled(scheduler.schedule()) == [("first", 4), ("second", 12)]  # first come, first served


@pytest.mark.exercise("6.1")
def test_admission_stops_at_max_num_seqs():
    scheduler, _ = make(max_num_seqs=2, budget=64)
    for name in "abc":
        scheduler.add(seq(name, 5))
    assert scheduled(scheduler.schedule()) == [("a", 5), ("b", 5)]
    assert [s.request_id for s in scheduler.waiting] == ["c"]


@pytest.mark.exercise("6.1")
def test_a_prompt_takes_its_blocks_chunk_by_chunk():
    scheduler, blocks = make(budget=20)
    scheduler.add(seq("long", 100))
    batch = scheduler.schedule()
    assert scheduled(batch) == [("long", 20)] and blocks.num_used == 2  # 20 tokens: 2 blocks, not 7
    run(scheduler, batch)
    scheduler.schedule()
    assert blocks.num_used == 3  # 40 tokens


@pytest.mark.exercise("6.1")
def test_when_the_pool_runs_dry_the_newest_prompt_gives_its_blocks_back():
    scheduler, blocks = make(num_blocks=6, budget=48)
    scheduler.add(seq("old", 80))  # 5 blocks
    scheduler.add(seq("new", 80))
    run(scheduler, scheduler.schedule())  # old: 48 tokens (3 blocks)
    batch = scheduler.schedule()  # old: 32 more (2 blocks); new: 16 (1 block): the pool is full
    assert scheduled(batch) == [("old", 32), ("new", 16)]
    run(scheduler, batch)
    scheduler.add(seq("later", 4))
    batch = scheduler.schedule()  # old decodes and needs a sixth block: new, the newest, is preempted
    assert scheduled(batch) == [("old", 1)]  # and nobody is admitted in a step that preempted
    assert [s.request_id for s in scheduler.waiting] == ["new", "later"] and scheduler.num_preemptions == 1
    assert scheduler.waiting[0].num_computed_tokens == 0 and blocks.num_used == 6


def test_a_budget_below_max_num_seqs_is_refused():
    with pytest.raises(AssertionError, match="must cover max_num_seqs"):
        make(max_num_seqs=8, budget=7)


# --- the mixed batch, as numbers -----------------------------------------------------------------


@pytest.mark.exercise("6.2")
def test_prepare_lays_out_decode_rows_and_chunks_and_samples_only_complete_sequences():
    blocks = block_manager.BlockManager(20, block_size=16)
    runner = model_runner.ModelRunner(None, None, blocks.block_size, torch.device("cpu"))
    decode = seq("decode", 17)
    decode.output_ids = [99]
    decode.num_computed_tokens, decode.num_scheduled_tokens = 17, 1  # position 17
    middle = seq("middle", 40)  # a chunk from position 16 to 23: not its last
    middle.num_computed_tokens, middle.num_scheduled_tokens = 16, 7
    last = seq("last", 30)  # its last chunk: 20 .. 29
    last.num_computed_tokens, last.num_scheduled_tokens = 20, 10
    for s, n in ((decode, 18), (middle, 23), (last, 30)):
        blocks.grow(s.block_table, n)
    step = runner.prepare(scheduler_module.Batch([decode, middle, last]))
    assert step.query_start_loc == [0, 1, 8, 18]
    assert step.seq_lens == [18, 23, 30]  # cached + new: what each sequence's queries see
    assert step.positions == [17, *range(16, 23), *range(20, 30)]
    assert step.input_ids == [99, *range(16, 23), *range(20, 30)]
    assert step.slot_mapping[0] == decode.block_table[1] * 16 + 1
    assert step.slot_mapping[1:8] == [middle.block_table[1] * 16 + i for i in range(7)]
    assert step.logits_indices == [0, 17]  # the decode and the last chunk's last row; the middle chunk samples not


def test_prepare_scores_prompt_rows_chunk_by_chunk():
    blocks = block_manager.BlockManager(20, block_size=16)
    runner = model_runner.ModelRunner(None, None, blocks.block_size, torch.device("cpu"))
    echo = sequence.Sequence("echo", list(range(30)), sampler.SamplingParams(max_tokens=1, prompt_logprobs=0),
                             generator=None, detokenizer=None)
    blocks.grow(echo.block_table, 30)
    rows = []
    for start, n in ((0, 16), (16, 14)):
        echo.num_computed_tokens, echo.num_scheduled_tokens = start, n
        rows.append(runner.prepare(scheduler_module.Batch([echo])).prompt_logits_indices)
    # 29 rows in all (the last prompt token predicts no prompt token): 16 from the first chunk, 13 from the second.
    assert rows == [list(range(16)), list(range(13))]


# --- the chunk's attention -----------------------------------------------------------------------


@pytest.mark.exercise("6.3")
@pytest.mark.parametrize("cached_new", [[(9, 7)], [(16, 7), (23, 9)], [(5, 1), (33, 16), (70, 1), (7, 30)]], ids=str)
def test_a_chunk_attends_causally_over_its_cached_context(cached_new):
    """Chunk j of a prompt, after c cached tokens, is rows c .. c + n - 1 of causal attention over the prompt."""
    seq_lens, num_new = [c + n for c, n in cached_new], [n for _, n in cached_new]
    q, k_cache, v_cache, tables, _, dense = paged_case(3, seq_lens, 16, num_kv_heads=3, group=3, head_dim=32,
                                                       num_queries=num_new)
    out = attention.extend_attention_reference(q, k_cache, v_cache, extend_meta(attention, cached_new, tables),
                                               scale=1 / math.sqrt(32))
    start = 0
    for (cached, new), (k, v) in zip(cached_new, dense, strict=True):
        full_q = torch.cat([torch.zeros(cached, *q.shape[1:]), q[start : start + new]])
        expected = dense_attention(full_q, k, v, causal=True)[cached:]
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-4, rtol=0)
        start += new


# --- the engine, on the embedded model -------------------------------------------------------------


def greedy(max_tokens: int, **kwargs):
    return sampler.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def run_all(engine) -> dict[str, list]:
    """Step until everyone is done; each request's outputs."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for output in engine.step().outputs:
            assert output.error is None, output.error
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def tokens(outputs) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


@pytest.fixture(scope="module")
def engine(model_dir):
    """Budget 16, no prefix cache: chunking alone (stage 05's library system prompt is seven chunks)."""
    return make_engine(FOLDER, model_dir, kv_cache_mb=64, max_num_batched_tokens=16, max_num_seqs=4,
                       prefix_cache="off")


@pytest.fixture(scope="module")
def unchunked(model_dir):
    """Stage 05's engine, each prompt in one step: what chunking must reproduce. Its own, not the session's
    ``engine05``, which a live server may be driving on its own thread."""
    return make_engine("05_prefix_cache", model_dir, kv_cache_mb=64)


@pytest.fixture
def cached_engine(model_dir):
    """Budget 16 with the prefix cache, fresh for each test: what it has cached is the test's own doing."""
    return make_engine(FOLDER, model_dir, kv_cache_mb=64, max_num_batched_tokens=16, max_num_seqs=4)


def test_a_long_prompt_joins_running_decodes_chunk_by_chunk_and_everyone_equals_hf(engine, hf_greedy):
    prompts = {f"short{i}": engine.encode_chat([{"role": "user", "content": q}])
               for i, q in enumerate(("Hi!", "Name a color."))}
    got: dict[str, list[int]] = {name: [] for name in [*prompts, "long"]}

    def collect(outputs) -> None:
        for output in outputs:
            assert output.error is None, output.error
            got[output.request_id] += output.token_ids

    for name, ids in prompts.items():
        engine.add_request(name, ids, greedy(24))
    while any(not engine.scheduler.sequences[name][0].output_ids for name in prompts):
        collect(engine.step().outputs)  # each prompt is a chunk or two
    prompts["long"] = chat(engine, "When are you open on Sunday?")
    engine.add_request("long", prompts["long"], greedy(12))
    step = engine.step().outputs
    collect(step)
    assert sorted(output.request_id for output in step) == ["short0", "short1"]  # the streams went on
    assert engine.scheduler.sequences["long"][0].num_computed_tokens == 16 - 2  # the budget after two decodes
    while engine.has_unfinished():
        collect(engine.step().outputs)
    for name, ids in prompts.items():
        assert got[name] == hf_greedy(ids, 12 if name == "long" else 24), name
    books_balance(engine)


def test_a_mid_prompt_chunk_produces_nothing_and_the_last_one_samples(engine, hf_greedy):
    prompt_ids = chat(engine, "Can I renew a book online?")
    engine.add_request("chunked", prompt_ids, greedy(8))
    steps = [engine.step().outputs for _ in range(-(-len(prompt_ids) // 16))]  # one chunk of 16 per step
    assert all(outputs == [] for outputs in steps[:-1])  # no token, no output, until the prompt is complete
    assert [output.completion_tokens for output in steps[-1]] == [1]  # its last chunk samples the first token
    rest = tokens(run_all(engine).get("chunked", []))
    assert tokens(steps[-1]) + rest == hf_greedy(prompt_ids, 8)
    books_balance(engine)


def test_the_hidden_states_of_a_chunked_prompt_equal_the_whole_prompts(model_dir):
    """The same positions through one pass or through chunks of 7 over the cache: equal within float32 rounding."""
    chunked_engine = make_engine(FOLDER, model_dir, kv_cache_mb=16, prefix_cache="off")
    chunked_engine.model.compute_logits = lambda hidden: hidden  # so that execute hands back the hidden states
    prompt_ids = chat(chunked_engine, "Is there a quiet room?")

    def hidden_states(chunk: int) -> torch.Tensor:
        s = seq("probe", 0)
        s.prompt_ids = prompt_ids
        chunked_engine.block_manager.grow(s.block_table, len(prompt_ids))
        rows = []
        for start in range(0, len(prompt_ids), chunk):
            s.num_computed_tokens, s.num_scheduled_tokens = start, min(chunk, len(prompt_ids) - start)
            step = chunked_engine.runner.prepare(scheduler_module.Batch([s]))
            step.logits_indices = list(range(len(step.input_ids)))  # every row, not only the last
            rows.append(chunked_engine.runner.execute(step)[0])
        chunked_engine.block_manager.free(s.block_table)
        return torch.cat(rows)  # [len(prompt), hidden]

    whole, chunked = hidden_states(len(prompt_ids)), hidden_states(7)
    assert whole.shape == (len(prompt_ids), chunked_engine.model.config.hidden_size)
    # float32 keeps about 7 significant digits, and a few dimensions of this model's residual stream reach
    # thousands: there, "the last bits" are 1e-3 to 1e-2 (chunks of 7 rows take matmul.py's transposed product,
    # the whole prompt F.linear: two roundings, 3e-6 of the largest value seen). So the bound is relative to it.
    scale = whole.abs().max()
    assert (chunked - whole).abs().max() <= 1e-5 * scale, f"{(chunked - whole).abs().max()} against {scale}"
    normed = chunked_engine.model.model.norm  # what the output projection sees: values of about 1 to 50
    torch.testing.assert_close(normed(chunked), normed(whole), atol=1e-4, rtol=1e-5)


def test_a_seeded_sample_is_the_same_chunked_or_not(engine, unchunked):
    params = sampler.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    prompt_ids = chat(engine, "Recommend a novel about the sea.")
    engine.add_request("seeded", prompt_ids, params)
    unchunked.add_request("seeded", prompt_ids, stage("05_prefix_cache", "sampler").SamplingParams(
        max_tokens=12, temperature=0.8, top_p=0.9, seed=7))
    assert tokens(run_all(engine)["seeded"]) == tokens(run_all(unchunked)["seeded"])  # mid-prompt steps draw nothing


def test_prompt_logprobs_cover_every_position_across_chunks(engine, unchunked):
    prompt_ids = chat(engine, "Do you have audiobooks?")
    engine.add_request("echo", prompt_ids, greedy(0, prompt_logprobs=2))
    unchunked.add_request("echo", prompt_ids, stage("05_prefix_cache", "sampler").SamplingParams(
        max_tokens=0, temperature=0.0, prompt_logprobs=2))
    chunked, whole = run_all(engine)["echo"][0].prompt_logprobs, run_all(unchunked)["echo"][0].prompt_logprobs
    assert len(chunked) == len(prompt_ids) - 1 == len(whole)
    assert [p.token_id for p in chunked] == prompt_ids[1:]
    for a, b in zip(chunked, whole, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    books_balance(engine)


def test_blocks_completed_by_a_chunk_are_cached_at_once(cached_engine, hf_greedy):
    """A prompt computed chunk by chunk registers each block as soon as a chunk fills it: a request that arrives
    meanwhile with the same beginning finds them, even though the first prompt is not complete."""
    first = chat(cached_engine, "Where are the history books?")
    cached_engine.add_request("first", first, greedy(8))
    for _ in range(3):
        cached_engine.step()  # 48 tokens: three whole blocks, the third filled by a chunk that ends at 48
    assert cached_engine.block_manager.num_cached == 3
    second = chat(cached_engine, "Can I renew a book online?")
    cached_engine.add_request("second", second, greedy(8))
    outputs = run_all(cached_engine)
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert outputs["second"][0].cached_tokens == common // 16 * 16 >= 48  # the first's blocks, chunk boundaries aside
    assert tokens(outputs["first"]) == hf_greedy(first, 8) and tokens(outputs["second"]) == hf_greedy(second, 8)
    books_balance(cached_engine)


def test_a_prompt_preempted_part_way_restarts_from_its_own_cached_blocks(model_dir, hf_greedy):
    """A pool of 5 blocks. A request decodes in 3 of them when a 40-token prompt arrives: the prompt takes the other
    2 chunk by chunk (its last chunk shrinks to what they hold) and waits with 32 tokens computed. When the decoding
    request needs a fourth block, the prompt, the newest, is preempted; it comes back after, and finds its first
    block still cached (its second, released first, was evicted for the fourth block)."""
    small = make_engine(FOLDER, model_dir, kv_cache_mb=4, max_num_batched_tokens=16, max_num_seqs=4)
    assert small.block_manager.num_blocks == 5
    decoding = small.encode_chat([{"role": "user", "content": "Count from one to twenty."}])
    prompt = small.encode("The library opens at nine and closes at six, except on Sundays, when it is closed. "
                          "Members may borrow ten books for three weeks; the fine for a late book is ten cents a day.")
    assert len(decoding) < 44 and 32 < len(prompt) <= 48
    small.add_request("decoding", decoding, greedy(64 - len(decoding)))
    got: dict[str, list[int]] = {"decoding": [], "prompt": []}
    while small.scheduler.sequences["decoding"][0].num_tokens < 44:
        for output in small.step().outputs:
            got[output.request_id] += output.token_ids
    small.add_request("prompt", prompt, greedy(4))
    for request_id, outputs in run_all(small).items():
        got[request_id] += tokens(outputs)
    assert small.scheduler.num_preemptions == 1
    assert small.scheduler.prefix_cache_hits == 16  # its own first block, found again
    assert got["decoding"] == hf_greedy(decoding, 64 - len(decoding))
    assert got["prompt"] == hf_greedy(prompt, 4)
    books_balance(small)


def test_abort_part_way_through_a_prompt_frees_everything(cached_engine):
    cached_engine.add_request("aborted", chat(cached_engine, "What is a library card?"), greedy(8))
    cached_engine.step()
    cached_engine.step()
    assert cached_engine.block_manager.num_used == 2 and cached_engine.has_unfinished()
    cached_engine.abort("aborted")
    books_balance(cached_engine)


def test_n_samples_of_a_chunked_prompt_equal_stage_05s(cached_engine, unchunked):
    prompt_ids = chat(cached_engine, "Suggest a book for a rainy day.")
    cached_engine.add_request("three", prompt_ids, sampler.SamplingParams(max_tokens=6, temperature=0.9, seed=3), n=3)
    unchunked.add_request("three", prompt_ids, stage("05_prefix_cache", "sampler").SamplingParams(
        max_tokens=6, temperature=0.9, seed=3), n=3)

    def by_sample(outputs) -> dict[int, list[int]]:
        samples: dict[int, list[int]] = {}
        for output in outputs:
            samples.setdefault(output.index, []).extend(output.token_ids)
        return samples

    ours = by_sample(run_all(cached_engine)["three"])
    assert ours == by_sample(run_all(unchunked)["three"]) and len(ours) == 3
    books_balance(cached_engine)


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
def test_the_command_line_refuses_a_budget_below_max_num_seqs():
    out = cli_help(FOLDER)
    assert "--max-num-batched-tokens" in out and "token budget" in out
    refused = subprocess.run([sys.executable, "-m", FOLDER, "--max-num-batched-tokens", "8", "--demo"], cwd=REPO,
                             capture_output=True, text=True)
    assert refused.returncode != 0
    assert "--max-num-batched-tokens 8 is below --max-num-seqs 64" in refused.stderr
