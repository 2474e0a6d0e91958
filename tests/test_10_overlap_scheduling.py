"""Stage 10: overlap scheduling. Step N + 1 is launched before step N's tokens are read; its input ids are
placeholders for them, resolved on the device.

The placeholders alone (exercise 10.2), the loop's order and its carry (10.1), then the engine: the same tokens as
the synchronous loop, greedy and seeded, with chunks and preemptions; a sequence that ends in step N never gets the
token step N + 1 computed for it; an abort while its step is in flight frees its blocks once; a sequence never runs
past ``max_tokens``, even when its last token is still on the device; each step that cannot overlap says why, in the
engine's counts and on /metrics. (Greedy tokens against Hugging Face's, and every server and API test of the stages
before, run for this stage in the every-stage tests.)"""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from .conftest import engine_config, make_engine, serve_stage, stage
from .cores import core_on_a_thread
from .prompts import CHAT_PROMPTS, TEXT_PROMPTS
from .servers import start_fastapi
from .syncs import count_syncs

FOLDER = "10_overlap_scheduling"
async_engine_module = stage(FOLDER, "async_engine")
executor = stage(FOLDER, "executor")
messages_module = stage(FOLDER, "messages")
model_runner = stage(FOLDER, "model_runner")
sampler = stage(FOLDER, "sampler")
sequence_module = stage(FOLDER, "sequence")

MODEL = "smollm2-135m-instruct"
GREEDY = sampler.SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def engines(model_dir):
    """(overlapping, synchronous) engines of this stage without speculation (whose steps never overlap), on a pool
    small enough that a long batch preempts. The overlapping one runs its steps on the CPU's device thread (the
    stand-in for a stream), where a launched step is still running when ``launch`` returns, as on a GPU."""
    config = {"speculative": "off", "kv_cache_mb": 64, "max_num_batched_tokens": 64}
    return (make_engine(FOLDER, model_dir, device_thread="on", **config),
            make_engine(FOLDER, model_dir, disable_overlap=True, **config))


def prompts_of(engine) -> list[list[int]]:
    return [engine.encode(p) for p in TEXT_PROMPTS] + [engine.encode_chat([{"role": "user", "content": p}])
                                                       for p in CHAT_PROMPTS]


def run_turns(engine) -> list:
    """Step until nothing is left; every turn's StepResult."""
    results = []
    while engine.has_unfinished():
        results.append(engine.step())
    return results


# --- the placeholders (exercise 10.2) ----------------------------------------------------------------------------
@pytest.mark.exercise("10.2")
def test_placeholders_become_the_tokens_of_their_rows_and_real_ids_stay():
    sampled = torch.tensor([50, 60, 70])  # the step in flight's tokens, by row
    ids = torch.tensor([5, sequence_module.placeholder(2), 7, sequence_module.placeholder(0),
                        sequence_module.placeholder(1), 0])
    assert model_runner.resolve_placeholders(ids, sampled).tolist() == [5, 70, 7, 50, 60, 0]


@pytest.mark.exercise("10.2")
def test_a_step_without_placeholders_is_unchanged_and_nothing_is_read_from_a_one_row_step():
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert model_runner.resolve_placeholders(ids, torch.tensor([9])).tolist() == [3, 1, 4, 1, 5]
    assert model_runner.resolve_placeholders(torch.tensor([-1, -1]), torch.tensor([9])).tolist() == [9, 9]


@pytest.mark.exercise("10.2")
def test_resolving_placeholders_reads_nothing_back_and_no_shape_depends_on_the_numbers():
    """On a GPU the resolve runs on the stream behind step N's sampling. A ``.tolist()`` or ``.item()`` of the ids
    would make the host wait for step N, the wait this stage removes; so would a boolean mask (``ids[ids < 0]``),
    whose result's shape the host learns only once the device has computed it. Counted here, on the CPU."""
    ids = torch.tensor([5, sequence_module.placeholder(2), 7, sequence_module.placeholder(0), 0])
    with count_syncs() as syncs:
        resolved = model_runner.resolve_placeholders(ids, torch.tensor([50, 60, 70]))
    assert syncs.reads == 0 and not syncs.list_indexing and not syncs.data_dependent, syncs.calls
    assert resolved.tolist() == [5, 70, 7, 50, 0]


@pytest.mark.exercise("10.2")
def test_a_sequences_placeholder_is_the_token_its_row_will_hold():
    seq = sequence_module.Sequence("r", [1, 2, 3], GREEDY, torch.Generator(), output_ids=[4])
    seq.pending_rows = [6]
    assert seq.num_tokens == 5 and seq.num_output_tokens == 2
    assert seq.tokens(3, 5) == [4, sequence_module.placeholder(6)]
    resolved = model_runner.resolve_placeholders(torch.tensor(seq.tokens(3, 5)), torch.arange(100, 107))
    assert resolved.tolist() == [4, 106]


# --- the read that waits for its own step (exercise 10.4) -------------------------------------------------------
class FakeEvent:
    """``torch.cuda.Event`` without a GPU: records when it was recorded and waited on, and times 2 ms between two."""

    log: list[str] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.timing = enable_timing

    def record(self) -> None:
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        return 2.0  # ms


@pytest.mark.exercise("10.4")
def test_on_cuda_a_read_waits_on_its_steps_event_and_never_on_the_whole_device(monkeypatch):
    """The CUDA path, on a CPU: the step's work is queued, then an event is recorded behind it; ``wait`` synchronizes
    on that event alone (``torch.cuda.synchronize`` would wait for every step launched since), and reads the device's
    time for the step from its two timing events."""
    monkeypatch.setattr(executor.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(executor.torch.cuda, "synchronize", lambda *a: pytest.fail("a read waited for the device"))
    FakeEvent.log = []
    device = executor.DeviceQueue(torch.device("cuda"), thread=True)  # CUDA's stream needs no thread: none starts
    assert device.asynchronous and not device.thread
    work = device.submit(lambda: executor.DeviceOutput(None, None, host=[torch.tensor([7])]))
    assert FakeEvent.log == ["record", "record", "record"]  # start, end, and done: behind the copy to the host
    output = work.wait()
    assert FakeEvent.log[3:] == ["synchronize"] and output.host[0].tolist() == [7]
    assert output.seconds == pytest.approx(0.002)


@pytest.mark.exercise("10.4")
def test_on_the_device_thread_step_ns_read_returns_while_step_n_plus_1_still_runs():
    device = executor.DeviceQueue(torch.device("cpu"), thread=True)
    release = threading.Event()
    first = device.submit(lambda: executor.DeviceOutput(None, None, host=[torch.tensor([1])]))
    second = device.submit(lambda: (release.wait(10), executor.DeviceOutput(None, None))[1])  # holds the queue
    try:
        assert first.wait().host[0].tolist() == [1]  # step N, read while step N + 1 has not finished
        assert not release.is_set()
    finally:
        release.set()
    assert second.wait().seconds > 0
    device.close()


@pytest.mark.exercise("10.4")
def test_a_steps_error_is_raised_by_its_own_read_and_the_next_step_still_runs():
    device = executor.DeviceQueue(torch.device("cpu"), thread=True)

    def fails() -> executor.DeviceOutput:
        raise RuntimeError("the step failed on the device")

    failed = device.submit(fails)
    after = device.submit(lambda: executor.DeviceOutput(None, None, host=[torch.tensor([2])]))
    with pytest.raises(RuntimeError, match="failed on the device"):
        failed.wait()
    assert after.wait().host[0].tolist() == [2]
    device.close()


# --- the loop and its carry (exercise 10.1) ----------------------------------------------------------------------
@pytest.mark.exercise("10.1")
def test_each_turn_launches_the_next_step_before_it_processes_the_one_in_flight(engines, monkeypatch):
    engine, _ = engines
    events: list[str] = []
    launch, postprocess = engine.executor.launch, engine.scheduler.postprocess
    monkeypatch.setattr(engine.executor, "launch", lambda *a, **k: (events.append("launch"), launch(*a, **k))[1])
    def process(batch, *args, **kwargs):
        events.append(f"process {len(batch.seqs)}")
        return postprocess(batch, *args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "postprocess", process)
    engine.add_request("order", prompts_of(engine)[0], sampler.SamplingParams(max_tokens=4, temperature=0.0))
    turns = run_turns(engine)
    # The prefill is launched with nothing in flight; each decode is launched before the step before it is read; the
    # last step's tokens are read in a turn that launches nothing.
    assert events == ["launch", "launch", "process 1", "launch", "process 1", "launch", "process 1", "process 1"]
    assert [len(turn.outputs) for turn in turns] == [0, 1, 1, 1, 1]
    assert engine.stats().overlap.synchronous == {}


def test_step_ns_news_reaches_the_caller_while_step_n_plus_1s_forward_pass_still_runs(engines, monkeypatch):
    """The CPU's stand-in for a stream (the device thread): a turn launches step N + 1 and returns step N's outputs
    without waiting for N + 1. With a forward pass made slow (0.3 s more), each output but the last leaves before the
    forward pass launched in its turn ends. (On a loop whose launch computes the step, each turn returns only after
    it: the synchronous timeline.)"""
    engine, _ = engines
    assert engine.executor.queue.asynchronous
    ends: list[float] = []
    execute = engine.runner.execute

    def slow(*args, **kwargs):
        out = execute(*args, **kwargs)
        time.sleep(0.3)
        ends.append(time.perf_counter())
        return out

    monkeypatch.setattr(engine.runner, "execute", slow)
    engine.add_request("slow", prompts_of(engine)[0], sampler.SamplingParams(max_tokens=4, temperature=0.0))
    returned = []
    while engine.has_unfinished():
        if engine.step().outputs:
            returned.append(time.perf_counter())
    assert len(returned) == 4 and len(ends) == 4  # one prefill, three decodes; each output in its own turn
    # Output i is step i's; it leaves in the turn that launched step i + 1, before that step's forward pass ends.
    assert all(left < ended for left, ended in zip(returned[:-1], ends[1:], strict=True)), (returned, ends)


@pytest.mark.exercise("10.1")
def test_a_launch_that_fails_is_carried_and_fails_its_sequences_a_turn_later(engines, monkeypatch):
    engine, _ = engines
    prepare, calls = engine.runner.prepare, []

    def failing(batch):
        calls.append(len(batch.seqs))
        if len(calls) == 3:  # the second decode
            raise RuntimeError("injected launch failure")
        return prepare(batch)

    monkeypatch.setattr(engine.runner, "prepare", failing)
    engine.add_request("fails", prompts_of(engine)[0], GREEDY)
    outputs = [output for turn in run_turns(engine) for output in turn.outputs]
    assert [len(output.token_ids) for output in outputs[:-1]] == [1, 1]  # the prefill's token, the first decode's
    assert "injected" in str(outputs[-1].error)  # the failed step's own error, read a turn later
    assert engine.stats().kv_blocks.used == 0 and engine.in_flight is None


@pytest.mark.exercise("10.1")
def test_overlapped_steps_give_the_synchronous_loops_tokens_greedy_and_seeded(engines):
    overlapping, synchronous = engines
    prompts = prompts_of(overlapping)
    overlapped = overlapping.stats().overlap.overlapped
    seeded = [sampler.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i) for i in range(len(prompts))]
    for params in (GREEDY, seeded):
        assert overlapping.generate_offline(prompts, params) == synchronous.generate_offline(prompts, params)
    assert overlapping.stats().overlap.overlapped - overlapped > 20  # the tokens came from overlapped steps
    assert synchronous.stats().overlap.overlapped == 0


@pytest.mark.exercise("10.3")
def test_preemptions_and_chunks_under_overlap_keep_the_tokens(model_dir, engines):
    _, synchronous = engines
    # 8 MiB: 11 blocks of 16 tokens for six sequences of 20-40 tokens: the newest give their blocks back, with a
    # step in flight, and are recomputed.
    small = make_engine(FOLDER, model_dir, speculative="off", kv_cache_mb=8, max_num_batched_tokens=64,
                        device_thread="on")
    prompts = prompts_of(small)
    seeded = [sampler.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i) for i in range(len(prompts))]
    for params in (GREEDY, seeded):  # a preempted sequence draws on from its own generator, where it left off
        assert small.generate_offline(prompts, params) == synchronous.generate_offline(prompts, params)
    stats = small.stats()
    assert stats.preemptions > 0 and stats.overlap.overlapped > 0
    assert stats.kv_blocks.used == 0 and small.in_flight is None


# --- ends, aborts, and the last token ---------------------------------------------------------------------------
@pytest.mark.exercise("10.3")
def test_a_sequence_that_ends_in_step_n_never_gets_the_token_step_n_plus_1_computed_for_it(engines):
    engine, synchronous = engines
    prompt = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    [full] = synchronous.generate_offline([prompt], GREEDY)
    assert full[-1] in engine.eos_token_ids and len(full) < GREEDY.max_tokens  # the answer ends with EOS
    engine.add_request("ends", prompt, GREEDY)
    outputs, dropped = [], 0
    while engine.has_unfinished():
        in_flight = engine.in_flight
        result = engine.step()
        if in_flight is not None and any(seq.request_id == "ends" for seq in in_flight.sampling):
            dropped += not [output for output in result.outputs if output.request_id == "ends"]
        outputs += [output for output in result.outputs if output.request_id == "ends"]
    assert outputs[-1].finish_reason == "stop" and [output.finished for output in outputs].count(True) == 1
    assert [token for output in outputs for token in output.token_ids] == full
    assert dropped == 1  # the step after the end computed a token for it, read and dropped


def test_a_stop_string_ends_a_sample_in_the_api_process_which_tells_the_core_to_drop_it(engines, monkeypatch):
    """The core knows no text: the API process finds the stop string, cuts the sample there (its text and its
    tokens), and sends the core an abort of that sample alone, which frees its blocks."""
    engine, synchronous = engines
    prompt = prompts_of(engine)[0]
    [full] = synchronous.generate_offline([prompt], GREEDY)
    stop = engine.tokenizer.decode(full[5:7])  # a stop string that ends the answer a few tokens in
    client = core_on_a_thread(FOLDER, engine)
    sent = []
    send = client._send
    monkeypatch.setattr(client, "_send", lambda message: (sent.append(message), send(message)))
    client.start()
    params = sampler.SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])
    outputs = asyncio.run(collect(client, prompt, params, n=2))  # two samples, each ended by the stop string
    try:
        for index in (0, 1):
            sample = [output for output in outputs if output.index == index]
            tokens = [token for output in sample for token in output.token_ids]
            text = "".join(output.text for output in sample)
            assert sample[-1].finish_reason == "stop" and sample[-1].completion_tokens == len(tokens)
            assert tokens == full[:len(tokens)] and len(tokens) <= 7
            assert stop not in text and (text + stop) in engine.tokenizer.decode(full)
        aborts = [message for message in sent if isinstance(message, messages_module.AbortRequest)]
        assert sorted(message.index for message in aborts) == [0, 1]  # each sample dropped alone
        deadline = time.monotonic() + 10
        while client.stats().kv_blocks.used or client.stats().running:
            assert time.monotonic() < deadline, client.stats()
            time.sleep(0.02)
    finally:
        client.stop()


@pytest.mark.exercise("10.3")
def test_the_blocks_a_decode_fills_are_indexed_once_their_tokens_are_known(engines):
    """Every decode's input is a token still on the device, so the block it completes can be indexed only when that
    token is read, in ``postprocess``. A request's prompt and answer then find every full block of the first's."""
    engine, _ = engines
    prompt = prompts_of(engine)[0]
    params = sampler.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    [answer] = engine.generate_offline([prompt], params)
    tokens = prompt + answer
    computed = len(tokens) - 1  # the last token was sampled, never run
    assert computed // 16 > len(prompt) // 16 + 1  # the decodes filled blocks of their own
    assert len(engine.block_manager.match(tokens)) == computed // 16


@pytest.mark.exercise("10.3")
def test_an_abort_while_its_step_is_in_flight_frees_its_blocks_once(engines, monkeypatch):
    engine, _ = engines
    freed: list[int] = []
    free = engine.block_manager.free
    monkeypatch.setattr(engine.block_manager, "free", lambda table: (freed.append(id(table)), free(table))[1])
    prompts = prompts_of(engine)
    engine.add_request("stays", prompts[0], GREEDY)
    engine.add_request("leaves", prompts[1], GREEDY)
    engine.step()
    engine.step()  # the first decode is in flight
    [leaving] = engine.scheduler.sequences["leaves"]
    assert leaving in engine.in_flight.sampling and leaving.block_table
    engine.abort("leaves")
    assert freed.count(id(leaving.block_table)) == 1
    later = [output.request_id for turn in run_turns(engine) for output in turn.outputs]
    assert "leaves" not in later and later.count("stays") > 1
    assert freed.count(id(leaving.block_table)) == 1  # and never again, when its step in flight was read
    assert engine.stats().kv_blocks.used == 0


def test_a_sequence_never_runs_past_max_tokens_while_its_last_token_is_on_the_device(model_dir):
    # 1 MiB: one block of 16 tokens. A prompt of 10 and 6 new tokens fill it exactly: a step for a 17th token would
    # need a second block, and the sequence would preempt itself.
    tiny = make_engine(FOLDER, model_dir, speculative="off", kv_cache_mb=1, device_thread="on")
    assert tiny.kv_capacity_tokens == 16
    prompt = tiny.encode("The history of the Roman Empire is long and full of wars and emperors")[:10]
    assert len(prompt) == 10
    params = sampler.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tiny.add_request("fills", prompt, params)
    turns = run_turns(tiny)
    assert sum(turn.num_tokens for turn in turns) == 10 + 5  # the prompt, and a decode for tokens 2 to 6
    assert [len(output.token_ids) for turn in turns for output in turn.outputs] == [1] * 6
    assert tiny.stats().preemptions == 0


# --- the core's messages (exercise 10.6) ------------------------------------------------------------------------
core_module = stage(FOLDER, "core")


class RecordingEngine:
    """What ``EngineCore`` asks of its engine between two turns, recorded: requests added, aborts (id, sample)."""

    def __init__(self) -> None:
        self.tp = SimpleNamespace(size=1)
        self.added: list[tuple[str, int]] = []
        self.aborted: list[tuple[str, int | None]] = []

    def add_request(self, request_id, prompt_ids, params, trace=None, n=1) -> None:
        self.added.append((request_id, n))

    def abort(self, request_id: str, index: int | None = None) -> None:
        self.aborted.append((request_id, index))

    def check_ranks(self) -> None:
        pass


@pytest.fixture
def core_and_pipe():
    import multiprocessing

    core_end, api_end = multiprocessing.Pipe()
    yield core_module.EngineCore(RecordingEngine(), core_end), api_end
    core_end.close()
    api_end.close()


def add(request_id: str, n: int = 1):
    return messages_module.AddRequest(request_id, [1, 2, 3], sampler.SamplingParams(max_tokens=4), n=n)


@pytest.mark.exercise("10.6")
def test_between_two_turns_the_core_applies_every_message_already_there(core_and_pipe):
    """Adds, a client gone (every sample of its request aborted, its blocks freed by the engine), a stop string
    (that sample alone), all taken in one call without waiting; Shutdown ends the loop."""
    core, api = core_and_pipe
    for message in (add("a", n=2), add("b"), messages_module.AbortRequest("a", index=1)):
        api.send(message)
    assert core._take_messages(block=False) is True
    assert core.engine.added == [("a", 2), ("b", 1)]
    assert core.remaining == {"a": {0}, "b": {0}}  # a's sample 1 ended by its stop string; sample 0 goes on
    assert core.engine.aborted == [("a", 1)]
    api.send(messages_module.AbortRequest("b"))  # b's client left
    api.send(messages_module.AbortRequest("a", index=0))  # a's last sample ends: the request has ended
    assert core._take_messages(block=False) is True
    assert core.remaining == {}
    assert core.engine.aborted == [("a", 1), ("b", None), ("a", 0)]
    assert core._take_messages(block=False) is True  # nothing there: return at once
    api.send(messages_module.Shutdown())
    assert core._take_messages(block=False) is False


@pytest.mark.exercise("10.6")
def test_an_abort_for_a_request_that_has_ended_changes_nothing(core_and_pipe):
    """The API process may send an abort for a request the core has just finished (the two cross in the pipe): it
    must not revive it, fail, or abort another request."""
    core, api = core_and_pipe
    api.send(add("c", n=2))
    api.send(messages_module.AbortRequest("gone"))
    api.send(messages_module.AbortRequest("c", index=5))
    assert core._take_messages(block=False) is True
    assert core.remaining == {"c": {0, 1}}
    assert all(request_id != "c" or index == 5 for request_id, index in core.engine.aborted)


# --- what cannot overlap (exercise 10.5) ------------------------------------------------------------------------
engine_module = stage(FOLDER, "engine")


def plain(**params) -> SimpleNamespace:
    """A scheduled sequence as ``sync_reason`` sees it: its reserved guesses and its sampling parameters."""
    return SimpleNamespace(num_lookahead_slots=0, params=sampler.SamplingParams(**params))


@pytest.mark.exercise("10.5")
@pytest.mark.parametrize(("ranks", "seqs", "reason"), [
    (1, [plain(), plain(temperature=0.7, seed=3, logprobs=2)], None),  # sampling and logprobs happen on the device
    (1, [plain(), plain(), SimpleNamespace(num_lookahead_slots=4, params=sampler.SamplingParams())], "speculation"),
    (1, [plain(), plain(presence_penalty=0.5)], "penalties"),
    (1, [plain(), plain(logit_bias={11: 2.0})], "penalties"),  # a bias is added from the host's list too
    (2, [plain()], "tensor_parallel"),  # every rank is fed step N's tokens by rank 0's host
    (2, [SimpleNamespace(num_lookahead_slots=4, params=sampler.SamplingParams(frequency_penalty=1.0))],
     "tensor_parallel"),
], ids=["nothing", "a-late-sequence-guesses", "presence", "logit-bias", "two-ranks", "two-ranks-first"])
def test_a_batch_waits_for_step_n_only_for_what_its_host_must_know(ranks, seqs, reason):
    """The reason names what needs step N's tokens on the host: any sequence's guesses (the proposer reads the last
    token), any sequence's penalties or bias (counted from the host's lists), several ranks (whatever the batch)."""
    engine = SimpleNamespace(tp=SimpleNamespace(size=ranks))
    assert engine_module.Engine.sync_reason(engine, SimpleNamespace(seqs=seqs)) == reason


@pytest.mark.exercise("10.5")
@pytest.mark.parametrize(("params", "reason"), [
    ({"frequency_penalty": 0.5}, "penalties"),
    ({"logit_bias": {11: 2.0}}, "penalties"),
], ids=["frequency", "logit-bias"])
def test_a_step_that_needs_a_token_on_the_host_runs_synchronously_and_says_why(engines, params, reason):
    overlapping, synchronous = engines
    prompts = prompts_of(overlapping)[:2]
    before = overlapping.stats().overlap.synchronous.get(reason, 0)
    each = [sampler.SamplingParams(max_tokens=8, temperature=0.0), sampler.SamplingParams(max_tokens=8, temperature=0.0,
                                                                                          **params)]
    assert overlapping.generate_offline(prompts, each) == synchronous.generate_offline(prompts, each)
    assert overlapping.stats().overlap.synchronous.get(reason, 0) > before


def answer(engine, prompt: list[int], params) -> list:
    """Every output of one request, stepped to its end."""
    engine.add_request("answer", prompt, params)
    return [output for turn in run_turns(engine) for output in turn.outputs]


def test_logprobs_and_a_prompts_logprobs_are_scored_on_the_device_and_overlap(engines):
    """Echo and logprobs need nothing the host lacks: the prompt's tokens are known at launch, and the chosen token's
    logprob is taken on the device beside it. Their steps overlap, and score what the synchronous loop scores."""
    overlapping, synchronous = engines
    params = sampler.SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    prompt = prompts_of(overlapping)[0]
    before = overlapping.stats().overlap
    overlapped, reference = answer(overlapping, prompt, params), answer(synchronous, prompt, params)
    after = overlapping.stats().overlap
    assert after.synchronous == before.synchronous and after.overlapped - before.overlapped >= 5
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in reference]
    scored = [(o.prompt_logprobs, o.logprobs) for o in overlapped]
    assert scored[0][0] is not None and len(scored[0][0]) == len(prompt) - 1  # the first output has the prompt's
    for (prompt_logprobs, logprobs), (want_prompt, want) in zip(scored, [(o.prompt_logprobs, o.logprobs)
                                                                          for o in reference], strict=True):
        for got, expected in zip((prompt_logprobs or []) + logprobs, (want_prompt or []) + want, strict=True):
            assert got.token_id == expected.token_id and [t for t, _ in got.top] == [t for t, _ in expected.top]
            assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)


@pytest.mark.exercise("10.5")
def test_steps_with_guesses_run_synchronously_and_give_the_same_tokens(model_dir, engines):
    _, synchronous = engines
    guessing = make_engine(FOLDER, model_dir, speculative="ngram", speculative_policy="always", kv_cache_mb=64,
                           max_num_batched_tokens=64, device_thread="on")
    prompts = [guessing.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6,"), *prompts_of(guessing)[:2]]
    assert guessing.generate_offline(prompts, GREEDY) == synchronous.generate_offline(prompts, GREEDY)
    stats = guessing.stats()
    assert stats.overlap.synchronous["speculation"] > 0 and stats.speculation.accepted > 0


def test_the_policy_charges_guesses_for_the_overlap_they_give_up():
    policy = stage(FOLDER, "policy")
    flat = policy.StepCost(((1, 0.010), (64, 0.012)))  # a GPU's step: a few more rows cost little
    cost = policy.SpeculationCost(verify=flat, decode=flat)
    assert policy.plan_guesses([0.3], [4], 1, cost) != [0]  # rows nearly free: a guess kept one time in three pays
    # Add a host's 5 ms that a step with guesses can no longer hide behind the device's: the guesses no longer pay,
    # but for a sequence whose guesses are nearly always kept.
    hidden = policy.SpeculationCost(verify=flat, decode=flat, sync=0.005)
    assert policy.plan_guesses([0.3], [4], 1, hidden) == [0]
    assert policy.plan_guesses([0.95], [4], 1, hidden) == [4]


def test_the_host_time_a_guess_gives_up_is_learned_on_the_turns_that_wait_too(model_dir):
    """The policy's charge for a guess is the host's time a turn, which overlapping would hide. It is measured on the
    turns that wait as well as on those that overlap: taken from overlapped turns alone, a workload whose steps all
    wait (here a penalized request: every step of it needs its tokens on the host) would never learn it. Where turns
    cannot overlap (a CPU without the device thread) it stays 0."""
    threaded = make_engine(FOLDER, model_dir, kv_cache_mb=16, device_thread="on")
    inline = make_engine(FOLDER, model_dir, kv_cache_mb=16)
    prompt = threaded.encode("The history of the Roman Empire")
    for engine in (threaded, inline):
        assert engine.scheduler.cost is not None and engine.scheduler.cost.sync == 0.0
        engine.generate_offline([prompt], sampler.SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=0.5))
    assert threaded.stats().overlap.overlapped == 0 and threaded.stats().overlap.synchronous["penalties"] > 0
    assert threaded.scheduler.cost.sync > 0.0 and inline.scheduler.cost.sync == 0.0


def test_metrics_and_health_count_overlapped_steps_and_each_reason_to_wait(engines):
    engine, _ = engines
    with serve_stage(FOLDER, engine) as server:
        def counts() -> dict[str, float]:
            lines = httpx.get(f"{server.url}/metrics").text.splitlines()
            waited = {line.split('reason="')[1].split('"')[0]: float(line.split()[-1]) for line in lines
                      if line.startswith("llm_sync_steps_total{")}
            overlapped = next(float(line.split()[-1]) for line in lines
                              if line.startswith("llm_overlapped_steps_total"))
            return waited | {"overlapped": overlapped}

        before = counts()
        for penalty in (0.5, 0.0):
            server.client().completions.create(model=MODEL, prompt="The history of the Roman Empire", max_tokens=8,
                                               temperature=0, frequency_penalty=penalty,
                                               extra_body={"ignore_eos": True})
        assert server.wait_idle()
        after = counts()
        assert after["penalties"] - before.get("penalties", 0) == 8  # each step of the first: its prefill, 7 decodes
        assert after["overlapped"] - before["overlapped"] == 7  # each step of the second but its first
        health = httpx.get(f"{server.url}/health").json()
        assert health["overlap"] == {"overlapped": engine.num_overlapped, "synchronous": engine.sync_steps}


# --- the engine core in its own process ------------------------------------------------------------------------


def core_config(model_dir, **overrides):
    """The config a server's core process builds its engine from: the ``engines`` fixture's."""
    return engine_config(FOLDER, model_dir, **({"speculative": "off", "kv_cache_mb": 64, "max_num_batched_tokens": 64}
                                                | overrides))


async def collect(engine, prompt_ids: list[int], params, n: int = 1) -> list:
    return [output async for output in engine.generate(prompt_ids, params, n=n)]


def test_a_core_process_answers_hugging_faces_tokens_one_message_a_turn_and_stops_cleanly(model_dir, hf_greedy,
                                                                                         monkeypatch):
    """A server's engine runs in a child process: greedy tokens through the pipe are Hugging Face's; each turn's
    news is one message for the whole batch; a client that leaves frees its blocks there; Shutdown ends it (exit 0)."""
    engine = async_engine_module.AsyncEngine(core_config(model_dir))
    assert engine._core.pid != os.getpid() and engine._core.is_alive()
    news_sizes = []
    take = engine._take
    monkeypatch.setattr(engine, "_take", lambda news: (news_sizes.append(len(news.outputs)), take(news)))
    engine.start()
    prompts = [engine.encode(p) for p in TEXT_PROMPTS] + [engine.encode_chat([{"role": "user", "content": p}])
                                                           for p in CHAT_PROMPTS]

    async def run() -> tuple[list[list], list]:
        answers = await asyncio.gather(*(collect(engine, ids, GREEDY) for ids in prompts))
        stream = engine.generate(prompts[0], sampler.SamplingParams(max_tokens=200, temperature=0.0))
        left = [await anext(stream) for _ in range(3)]
        await stream.aclose()  # the client left after 3 tokens: the core drops the request
        return answers, left

    answers, left = asyncio.run(run())
    for ids, outputs in zip(prompts, answers, strict=True):
        assert [token for output in outputs for token in output.token_ids] == hf_greedy(ids, GREEDY.max_tokens)
        assert outputs[-1].finished and outputs[-1].error is None
    assert len(left) == 3 and not left[-1].finished
    assert max(news_sizes) >= len(prompts) // 2  # one message carried many requests' tokens
    deadline = time.monotonic() + 10
    while engine.stats().kv_blocks.used or engine.stats().running:  # the abort reached the core, which freed
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)
    engine.stop()
    assert engine._core.exitcode == 0 and not engine.alive


def test_a_core_process_that_dies_fails_its_requests_at_once_and_the_server_says_503(model_dir):
    engine = async_engine_module.AsyncEngine(core_config(model_dir))
    with start_fastapi(stage(FOLDER, "server").create_app(engine, MODEL)) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                             "max_tokens": 500, "stream": True,
                                                             "ignore_eos": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(engine._core.pid, signal.SIGKILL)  # the core dies mid-stream
            rest = [line for line in lines if line.startswith("data:")]
        assert "engine_stopped" in rest[-2] and rest[-1] == "data: [DONE]"  # the stream ends with the error
        assert client.get("/health").status_code == 503
        refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stopped"
    assert engine._core.exitcode == -signal.SIGKILL


def test_a_core_that_cannot_start_says_why_and_a_core_whose_api_process_left_exits(model_dir):
    with pytest.raises(async_engine_module.CoreFailedToStart, match="--max-num-batched-tokens 8 is below"):
        async_engine_module.AsyncEngine(core_config(model_dir, max_num_seqs=64, max_num_batched_tokens=8))
    engine = async_engine_module.AsyncEngine(core_config(model_dir))
    engine._conn.close()  # as if the API process had been killed: the core reads the end of its pipe
    engine._core.join(timeout=30)
    assert engine._core.exitcode == 0


IMPORT_THE_API_PROCESS = """
import importlib, importlib.util, sys
package, init = sys.argv[1:]
spec = importlib.util.spec_from_file_location(package, init)  # the stage's folder, as tests/conftest.py loads it
sys.modules[package] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules[package])
for module in ("__main__", "server", "async_engine"):  # what `python -m` of the stage, serving, imports
    importlib.import_module(package + "." + module)
print(sorted(name for name in sys.modules if name.startswith(package + ".")))
"""
CORE_MODULES = ("engine", "core", "scheduler", "model_runner", "executor")  # the core process's alone


def test_the_api_process_imports_no_engine():
    """The API process (``__main__.py``, ``server.py``, ``async_engine.py``) parses, tokenizes, detokenizes and
    streams: it must not load the engine, its scheduler or its model runner, which are the core process's.
    Unpickling a message imports the module that defines its class, so the messages live in ``messages.py``, which
    imports none of them; the core's entry point imports ``core.py`` in the child alone; the demo and a worker import
    the engine when they run. Checked in a fresh process (this one has loaded them all)."""
    init = Path(async_engine_module.__file__).parent / "__init__.py"
    repo = Path(__file__).resolve().parent.parent  # for `common`
    done = subprocess.run([sys.executable, "-c", IMPORT_THE_API_PROCESS, FOLDER, str(init)], capture_output=True,
                          text=True, timeout=300, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
    assert sorted({f"{FOLDER}.{name}" for name in CORE_MODULES} & loaded) == []
    assert {f"{FOLDER}.server", f"{FOLDER}.messages"} <= loaded
