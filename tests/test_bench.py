"""The benchmark harness: the load generator against live stages 01 and 02, its aggregate math,
the figure, `python -m common.bench` end to end (it must leave no server behind), and the shared-prefix
workload that measures a prefix cache."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np
import pytest

from common import bench, loadgen, plots
from common.loadgen import InFlight, LevelResult, RequestRecord
from common.trace import Tracer

from .conftest import REPO, serve_stage, stage

MODEL = "smollm2-135m-instruct"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_level(url: str, *, stream: bool, concurrency: int, num_requests: int, max_tokens: int) -> LevelResult:
    workload = loadgen.Workload(url, MODEL, max_tokens=max_tokens, stream=stream)
    return asyncio.run(loadgen.run_level(workload, concurrency, num_requests))


def test_loadgen_streams_against_stage_02(server02):
    assert server02.wait_idle()  # the in-flight counts below are this test's alone
    assert asyncio.run(loadgen.probe_streaming(server02.url, MODEL))
    # The probe's request may still be counted for a moment after its answer (the engine thread ends it): let it go.
    assert server02.wait_idle()
    level = run_level(server02.url, stream=True, concurrency=3, num_requests=6, max_tokens=12)
    assert len(level.records) == 6
    for record in level.records:
        assert record.ok, record.error
        assert record.output_tokens == 12  # ignore_eos: exactly max_tokens, from the usage chunk
        assert 0 < record.ttft_s <= record.e2e_s
        assert record.itl_s is not None and record.itl_s > 0
    summary = level.summary()
    assert summary["errors"] == 0 and summary["output_tokens"] == 72
    for metric in ("ttft_s", "itl_s", "e2e_s"):
        assert summary[metric]["p50"] <= summary[metric]["p99"]
    # The server counted the requests (running + waiting), never more than the client let out.
    assert level.in_flight.source == "server"
    counts = [n for _, n in level.in_flight.samples]
    assert counts and 1 <= max(counts) <= 3
    # Busy seconds read before and after the level: the engine computed for part of it, never more than all.
    assert level.engine_busy is not None and 0 < level.engine_busy <= 1 and summary["engine_busy"] == level.engine_busy


def test_loadgen_says_where_a_tokens_time_went_on_a_batching_stage(server04):
    assert server04.wait_idle()
    level = run_level(server04.url, stream=True, concurrency=2, num_requests=4, max_tokens=8)
    summary = level.summary()
    assert summary["errors"] == 0
    # 4 requests of 8 tokens, at most 2 at a time: at least 4 * 8 / 2 steps, at most one per token and prompt.
    assert 16 <= summary["steps"] <= 4 * 8 + 4
    phases = summary["step_phases_ms"]
    assert {"schedule", "prepare", "execute", "sample", "update", "detokenize", "handoff"} <= phases.keys()
    assert all(ms >= 0 for ms in phases.values()) and phases["execute"] > 0
    # The forward pass is most of a step on a CPU, yet not all of a token's time.
    assert phases["execute"] == max(phases.values())
    assert summary["decode_step_ms"] > 0
    assert 0 < summary["server_share"] < 1 and 0 < summary["client_share"] < 1
    assert summary["server_share"] == pytest.approx(1 - summary["decode_step_ms"] / summary["server_itl_ms"])
    assert summary["client_share"] == pytest.approx(1 - summary["decode_step_ms"] / 1000 / summary["itl_s"]["mean"])
    # The client's ITL adds the way to it (the chunk written out, the network, its parsing) to the server's.
    assert summary["server_itl_ms"] <= 1000 * summary["itl_s"]["mean"] * 1.05


def test_step_phases_from_metrics_pages():
    def page(steps: int, execute_s: float, sample_s: float) -> str:
        return ("# TYPE llm_step_phase_seconds histogram\n"
                f'llm_step_phase_seconds_bucket{{le="0.1",phase="schedule"}} {steps}\n'
                f'llm_step_phase_seconds_count{{phase="schedule"}} {steps}\n'
                f'llm_step_phase_seconds_sum{{phase="schedule"}} {0.001 * steps}\n'
                f'llm_step_phase_seconds_count{{phase="execute"}} {steps}\n'
                f'llm_step_phase_seconds_sum{{phase="execute"}} {execute_s}\n'
                f'llm_step_phase_seconds_count{{phase="sample"}} {steps}\n'
                f'llm_step_phase_seconds_sum{{phase="sample"}} {sample_s}\n'
                f"llm_decode_step_seconds_count {4 * steps}\n"  # four sequences decoding in each
                f"llm_decode_step_seconds_sum {4 * execute_s}\n"
                f"llm_inter_token_latency_seconds_count {4 * steps}\n"  # and a token each from it
                f"llm_inter_token_latency_seconds_sum {4 * (execute_s + sample_s)}\n")

    before, after = loadgen.Counters.parse(page(10, 0.5, 0.1)), loadgen.Counters.parse(page(30, 1.5, 0.3))
    phases = loadgen.step_phases_between(before, after)
    assert phases.steps == 20
    assert phases.mean_s == pytest.approx({"schedule": 0.001, "execute": 0.05, "sample": 0.01})
    assert phases.decode_step_s == pytest.approx(0.05)  # 80 tokens waited for 4.0 s of forward passes in all
    # The server gave each token 60 ms after the one before, for a 50 ms forward pass: its own time is a sixth. The
    # client saw 80 ms (the extra 20 is the way to it): 30 ms of each token's 80 were not the model's.
    time = loadgen.token_time(phases, {"mean": 0.08})
    assert time["server_itl_ms"] == pytest.approx(60.0) and time["decode_step_ms"] == pytest.approx(50.0)
    assert time["server_share"] == pytest.approx(1 / 6) and time["client_share"] == pytest.approx(0.375)
    assert time["step_phases_ms"] == pytest.approx({"schedule": 1.0, "execute": 50.0, "sample": 10.0})
    # A stage that does not count its phases (01 to 03), or a level with no step: nothing to say.
    none = loadgen.Counters.parse("llm_engine_busy_seconds_total 4.0\n")
    assert none.phases is None and loadgen.step_phases_between(none, none) is None
    assert loadgen.token_time(None, {"mean": 0.08}) == {"steps": None, "step_phases_ms": None, "decode_step_ms": None,
                                                         "server_itl_ms": None, "server_share": None,
                                                         "client_share": None, "overlapped_steps": None,
                                                         "synchronous_steps": None}
    assert loadgen.token_time(loadgen.step_phases_between(after, after), None)["server_share"] is None
    assert time["overlapped_steps"] is None  # a stage before 10 does not overlap


def test_a_levels_overlapped_and_synchronous_steps_from_metrics_pages():
    """Stage 10 on: how many of a level's steps overlapped the one before, and why the others waited, by reason."""
    def page(steps: int, overlapped: int, speculation: int) -> str:
        return (f'llm_step_phase_seconds_count{{phase="schedule"}} {steps}\n'
                f'llm_step_phase_seconds_sum{{phase="schedule"}} {0.001 * steps}\n'
                f"llm_overlapped_steps_total {overlapped}\n"
                f"llm_overlapped_steps_created 1.7e9\n"
                f'llm_sync_steps_total{{reason="speculation"}} {speculation}\n'
                f'llm_sync_steps_total{{reason="penalties"}} 2.0\n'
                f'llm_sync_steps_created{{reason="speculation"}} 1.7e9\n')

    before, after = loadgen.Counters.parse(page(10, 4, 5)), loadgen.Counters.parse(page(40, 30, 8))
    phases = loadgen.step_phases_between(before, after)
    time = loadgen.token_time(phases, None)
    assert time["overlapped_steps"] == 26 and time["synchronous_steps"] == {"speculation": 3, "penalties": 0}


def test_loadgen_without_streaming_against_stage_01(server01):
    assert not asyncio.run(loadgen.probe_streaming(server01.url, MODEL))  # stage 01 answers 400
    level = run_level(server01.url, stream=False, concurrency=2, num_requests=3, max_tokens=8)
    for record in level.records:
        assert record.ok, record.error
        assert record.output_tokens == 8
        assert record.ttft_s == record.e2e_s  # every token arrives at once, at the end
        assert record.itl_s is None  # no gaps to observe
    summary = level.summary()
    assert summary["itl_s"] is None and summary["errors"] == 0
    assert level.in_flight.source == "client"  # stage 01 has no /metrics
    assert level.engine_busy is None and summary["engine_busy"] is None  # so no busy seconds either
    assert max(n for _, n in level.in_flight.samples) <= 2


def test_summary_math_on_hand_made_records():
    records = [RequestRecord(i, start_s=0.0, ok=True, ttft_s=e2e / 4, itl_s=0.01 * (i + 1), e2e_s=e2e,
                             output_tokens=10) for i, e2e in enumerate([1.0, 2.0, 3.0, 4.0])]
    records.append(RequestRecord(4, start_s=0.0, error="ConnectError: refused"))
    level = LevelResult(concurrency=4, wall_s=2.0, records=records, in_flight=InFlight("client", [(0.0, 2), (0.1, 4)]))
    summary = level.summary()
    assert summary["requests"] == 5 and summary["errors"] == 1
    assert summary["output_tokens"] == 40 and summary["output_tokens_per_s"] == pytest.approx(20.0)  # 40 / 2 s
    # Linear interpolation: p50 of 1..4 is 2.5; p99 is 99% of the way from the 1st to the 4th value.
    assert summary["e2e_s"] == pytest.approx({"mean": 2.5, "p50": 2.5, "p99": 3.97})
    assert summary["ttft_s"] == pytest.approx({"mean": 0.625, "p50": 0.625, "p99": 0.9925})
    assert summary["itl_s"]["mean"] == pytest.approx(0.025)
    assert summary["in_flight"] == {"source": "client", "mean": 3.0, "max": 4}
    assert loadgen.Stats.of([]) is None
    assert loadgen.Stats.of([7.0]) == loadgen.Stats(7.0, 7.0, 7.0)


def test_parse_in_flight():
    page = """# HELP llm_requests_running Requests the engine is generating for.
# TYPE llm_requests_running gauge
llm_requests_running 1.0
llm_requests_waiting 3.0
llm_generation_tokens_total 120.0
vllm:num_requests_running{model_name="m"} 2.0
"""
    assert loadgen.parse_in_flight(page) == 6
    assert loadgen.parse_in_flight("# nothing\nother_metric 5\n") is None
    busy = "# TYPE llm_engine_busy_seconds counter\nllm_engine_busy_seconds_total 12.5\nllm_engine_busy_seconds_x 1\n"
    assert loadgen.sum_series(busy, (loadgen.BUSY_METRIC,)) == 12.5
    assert loadgen.sum_series(page, (loadgen.BUSY_METRIC,)) is None


def fake_result(name: str, streaming: bool) -> dict:
    def stats(value: float) -> dict[str, float]:
        return {"mean": value, "p50": value, "p99": 1.5 * value}

    levels = [{"concurrency": c, "output_tokens_per_s": 10.0 * c, "e2e_s": stats(0.5 * c),
               "ttft_s": stats(0.1 * c), "itl_s": stats(0.05) if streaming else None,
               "in_flight": {"source": "server" if streaming else "client", "mean": c * 0.9, "max": c},
               "engine_busy": min(1.0, 0.3 * c) if streaming else None}
              for c in (1, 4, 8)]
    return {"name": name, "model": MODEL, "device": "cpu", "dtype": "float32", "levels": levels,
            "workload": {"levels": [1, 4, 8], "requests_per_level": 8, "max_tokens": 16}}


def test_plot_writes_a_png(tmp_path):
    out = plots.plot_results([fake_result("01_naive", False), fake_result("02_streaming", True)],
                             tmp_path / "figure.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_result_json_round_trips():
    result = fake_result("02_streaming", True)
    result["levels"][0]["in_flight"]["samples"] = [[0.0, 1], [0.1, 2]]
    assert json.loads(bench.dumps(result)) == result


def running_commands() -> set[str]:
    """The command line of every process on this machine (Linux: from /proc)."""
    commands = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().rstrip(b"\0").decode().split("\0")
        except OSError:  # the process ended while we looked
            continue
        commands.add(shlex.join(argv))
    return commands


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
def test_bench_quick_end_to_end(tmp_path):
    # --quick's levels, fewer and shorter requests to keep the test suite fast.
    command = [sys.executable, "-m", "common.bench", "--stage", "02", "--quick", "--requests", "4",
               "--max-tokens", "8", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]

    result = json.loads((tmp_path / "02_streaming.json").read_text())
    for key in ("name", "model", "device", "dtype", "streaming", "workload", "machine", "command",
                "server_command", "git_commit", "date", "levels"):
        assert key in result
    assert result["name"] == "02_streaming" and result["streaming"] and result["quick"]
    assert [level["concurrency"] for level in result["levels"]] == bench.QUICK.levels
    for level in result["levels"]:
        assert level["errors"] == 0 and len(level["records"]) == 4
        assert all(r["output_tokens"] == 8 for r in level["records"])
        assert level["in_flight"]["source"] == "server"
    assert (tmp_path / "02_streaming.png").read_bytes()[:8] == PNG_MAGIC

    # The server is gone: nothing answers on its port, and no process has its command line.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{result['url']}/health", timeout=2)
    if Path("/proc").is_dir():
        assert result["server_command"] not in running_commands()


def test_bench_measures_a_running_server_by_url(server02, tmp_path):
    """--url: no subprocess; the same sweep and files, filed under the label, overlaid with --compare."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps(fake_result("01_naive", False)))
    bench.main(["--url", server02.url, "--model", MODEL, "--name", "outside", "--device", "cpu", "--levels", "2",
                "--requests", "2", "--max-tokens", "4", "--out", str(tmp_path), "--compare", str(other)])
    result = json.loads((tmp_path / "outside.json").read_text())
    assert result["name"] == "outside" and result["stage"] is None and result["server_command"] is None
    assert result["dtype"] is None  # not told, and a client cannot see it
    assert result["levels"][0]["errors"] == 0 and result["levels"][0]["output_tokens"] == 8
    assert (tmp_path / "outside.png").read_bytes()[:8] == PNG_MAGIC


def test_extra_body_adds_and_removes_request_fields():
    """--extra-body, for peers that refuse our fields: a value is merged in, a null removes the field."""
    workload = loadgen.Workload("http://x", MODEL, max_tokens=4, extra_body={"ignore_eos": None, "seed": 3})
    body = workload.body(0)
    assert "ignore_eos" not in body and body["seed"] == 3 and body["max_tokens"] == 4
    assert loadgen.Workload("http://x", MODEL, max_tokens=4).body(0)["ignore_eos"] is True
    args = bench.parse_args(["--url", "http://x", "--name", "peer", "--extra-body", '{"ignore_eos": null}'])
    assert args.extra_body == {"ignore_eos": None}


def test_server_args_reach_the_stages_command_as_separate_arguments():
    """--server-args: one string, split as a shell would, e.g. to benchmark stage 07 with --enforce-eager."""
    args = bench.parse_args(["--stage", "07", "--server-args=--enforce-eager --max-num-seqs 8"])
    assert args.server_args == ["--enforce-eager", "--max-num-seqs", "8"]
    assert bench.parse_args(["--stage", "07"]).server_args == []


# --- the shared-prefix workload (a prefix cache's benchmark, stage 05) ----------------------------


def test_shared_prefix_is_a_deterministic_system_prompt_of_about_the_asked_length(model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert loadgen.shared_prefix(0) == ""  # off: the standard workload
    for tokens in (200, loadgen.DEFAULT_SHARED_PREFIX_TOKENS, 3000):
        prefix = loadgen.shared_prefix(tokens)
        assert prefix == loadgen.shared_prefix(tokens)  # no randomness: every run sends the same text
        assert len(tokenizer.encode(prefix).ids) == pytest.approx(tokens, rel=0.1)
    prefix = loadgen.shared_prefix(loadgen.DEFAULT_SHARED_PREFIX_TOKENS)
    assert prefix.startswith("You are a helpful assistant for ACME")
    assert len(set(prefix.split())) > 200  # prose, not one word repeated


def test_shared_prefix_workload_puts_the_prefix_before_every_prompt(model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prefix = loadgen.shared_prefix(300)
    workload = loadgen.Workload("http://x", MODEL, max_tokens=64, shared_prefix=prefix)
    prefix_ids = tokenizer.encode(prefix).ids
    prompts = [workload.body(i)["prompt"] for i in range(2 * len(loadgen.PROMPTS))]
    for prompt in prompts:
        assert prompt.startswith(prefix)
        # The same first tokens, whatever the question: a cache of token blocks can match the whole prefix.
        assert tokenizer.encode(prompt).ids[:len(prefix_ids)] == prefix_ids
    suffixes = [prompt.removeprefix(prefix) for prompt in prompts]
    assert all(a != b for a, b in zip(suffixes, suffixes[1:], strict=False))  # consecutive requests differ
    assert suffixes[:len(loadgen.PROMPTS)] == loadgen.PROMPTS
    body = workload.body(3)
    assert {k: v for k, v in body.items() if k != "prompt"} == {
        k: v for k, v in loadgen.Workload("http://x", MODEL, max_tokens=64).body(3).items() if k != "prompt"}


def test_default_workload_request_bodies_are_unchanged():
    """Without a shared prefix, the requests are byte for byte those of every committed result."""
    streaming = loadgen.Workload("http://x", MODEL, max_tokens=64)
    assert json.dumps(streaming.body(9)) == (
        '{"prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0, "ignore_eos": true, "stream": true, '
        '"model": "smollm2-135m-instruct", "stream_options": {"include_usage": true}}')
    whole = loadgen.Workload("http://x", None, max_tokens=16, stream=False)
    assert json.dumps(whole.body(0)) == (
        '{"prompt": "The history of the Roman Empire", "max_tokens": 16, "temperature": 0, "ignore_eos": true, '
        '"stream": false}')


def test_prefix_cache_hit_rate_from_metrics_pages():
    def page(queries: float, hits: float) -> str:
        return (f"# HELP llm_prefix_cache_queries_total Prompt tokens looked up in the prefix cache.\n"
                f"# TYPE llm_prefix_cache_queries_total counter\nllm_prefix_cache_queries_total {queries}\n"
                f"llm_prefix_cache_hits_total {hits}\nllm_engine_busy_seconds_total 3.0\n")

    before, after = loadgen.Counters.parse(page(1000, 0)), loadgen.Counters.parse(page(5000, 3000))
    assert before == loadgen.Counters(busy_s=3.0, prefix_queries=1000, prefix_hits=0)
    assert loadgen.prefix_hit_rate_between(before, after) == pytest.approx(0.75)  # 3000 of the level's 4000
    assert loadgen.prefix_hit_rate_between(after, after) is None  # nothing looked up during the level
    # vLLM's names, with labels, are summed over their series.
    vllm = ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 80.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 20.0\n')
    assert loadgen.prefix_hit_rate_between(loadgen.Counters(prefix_queries=0, prefix_hits=0),
                                           loadgen.Counters.parse(vllm)) == pytest.approx(0.25)
    no_cache = loadgen.Counters.parse("llm_engine_busy_seconds_total 4.0\n")  # stages 02-04
    assert no_cache.prefix_queries is None and loadgen.prefix_hit_rate_between(no_cache, no_cache) is None
    assert loadgen.engine_busy_between(loadgen.Counters(busy_s=1.0), no_cache, wall_s=6.0) == pytest.approx(0.5)

    record = RequestRecord(0, start_s=0.0, ok=True, ttft_s=0.1, itl_s=0.01, e2e_s=1.0, output_tokens=10)
    level = LevelResult(1, 1.0, [record], InFlight("server", [(0.0, 1)]), prefix_cache_hit_rate=0.75)
    assert level.summary()["prefix_cache_hit_rate"] == 0.75
    assert "prefix cache hits  75%" in loadgen.format_summary(level.summary())
    level.prefix_cache_hit_rate = None
    assert "prefix cache" not in loadgen.format_summary(level.summary())


def test_shared_prefix_results_have_their_own_name_and_comparison(tmp_path):
    assert bench.result_name("05_prefix_cache", 0) == "05_prefix_cache"
    assert bench.result_name("05_prefix_cache", loadgen.DEFAULT_SHARED_PREFIX_TOKENS) == "05_prefix_cache_shared_prefix"
    assert bench.result_name("peer", 2000) == "peer_shared_prefix_2000"
    assert bench.result_name("peer_shared_prefix", 1000) == "peer_shared_prefix"  # already says it
    assert bench.parse_args(["--stage", "05"]).shared_prefix_tokens == 0
    assert bench.parse_args(["--stage", "05", "--shared-prefix-tokens"]).shared_prefix_tokens == 1000
    assert bench.parse_args(["--stage", "05", "--shared-prefix-tokens", "500"]).shared_prefix_tokens == 500
    # The figure overlays the previous stage's result for the same workload only.
    standard, shared = fake_result("04_continuous_batching", True), fake_result("04_continuous_batching", True)
    shared["workload"]["shared_prefix_tokens"] = 1000
    (tmp_path / "04_continuous_batching.json").write_text(json.dumps(standard))  # written before the option
    (tmp_path / "04_continuous_batching_shared_prefix.json").write_text(json.dumps(shared))
    assert [p.name for p in bench.previous_stage_result(tmp_path, "05")] == ["04_continuous_batching.json"]
    assert [p.name for p in bench.previous_stage_result(tmp_path, "05", 1000)] == [
        "04_continuous_batching_shared_prefix.json"]
    assert bench.previous_stage_result(tmp_path, "05", 2000) == []
    # A stage's other results (its step timings, say) are no sweep to compare with: passed over, not a crash.
    (tmp_path / "04_continuous_batching_decode_steps.json").write_text(json.dumps({"steps": []}))
    assert [p.name for p in bench.previous_stage_result(tmp_path, "05")] == ["04_continuous_batching.json"]


def test_bench_shared_prefix_against_a_running_server_by_url(server02, tmp_path):
    """--url with --shared-prefix-tokens: the result records the prefix and is filed under its own name."""
    bench.main(["--url", server02.url, "--model", MODEL, "--name", "outside", "--device", "cpu", "--levels", "2",
                "--requests", "2", "--max-tokens", "2", "--out", str(tmp_path), "--shared-prefix-tokens", "100"])
    assert not (tmp_path / "outside.json").exists()
    result = json.loads((tmp_path / "outside_shared_prefix_100.json").read_text())
    assert result["name"] == "outside_shared_prefix_100"
    assert result["workload"]["shared_prefix_tokens"] == 100
    assert result["workload"]["shared_prefix"] == loadgen.shared_prefix(100)
    level = result["levels"][0]
    assert level["errors"] == 0 and level["output_tokens"] == 4
    assert level["prefix_cache_hit_rate"] is None  # stage 02 has no prefix cache, so no counters


# --- the open loop: requests at a rate (--request-rate) ------------------------------------------------------


def test_poisson_arrivals_have_gaps_of_mean_one_over_the_rate_and_repeat_with_their_seed():
    times = loadgen.arrival_times(4.0, 20_001, "poisson", seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and len(times) == 20_001 and (gaps > 0).all()
    # Exponential gaps: mean 1/R, and a standard deviation as large as the mean (what makes bursts).
    assert gaps.mean() == pytest.approx(0.25, rel=0.03) and gaps.std() == pytest.approx(0.25, rel=0.05)
    assert loadgen.arrival_times(4.0, 50, seed=1) == times[:50]  # the same seed, the same schedule
    assert loadgen.arrival_times(4.0, 50, seed=2) != times[:50]
    # Every rate of a sweep gets the same pattern of bursts, scaled: twice the rate, half the times.
    assert loadgen.arrival_times(8.0, 50, seed=1) == pytest.approx([t / 2 for t in times[:50]])
    assert loadgen.arrival_times(4.0, 1) == [0.0] and loadgen.arrival_times(4.0, 0) == []


def test_fixed_arrivals_are_exactly_one_over_the_rate_apart():
    times = loadgen.arrival_times(3.0, 10, "fixed", seed=7)
    assert times[0] == 0.0 and len(times) == 10
    assert np.diff(times) == pytest.approx([1 / 3] * 9, abs=1e-12)
    assert times == loadgen.arrival_times(3.0, 10, "fixed", seed=8)  # no randomness: the seed is not used


def test_open_loop_sends_on_schedule_while_the_server_is_still_busy(server02):
    """Stage 02 serves one request at a time. A closed loop of one would send the next request only after the
    previous answer; the open loop sends all six within 0.1 s, and the later ones wait (their TTFT grows)."""
    assert server02.wait_idle()
    workload = loadgen.Workload(server02.url, MODEL, max_tokens=8)
    arrivals = loadgen.arrival_times(50.0, 6, "fixed")
    result = asyncio.run(loadgen.run_rate(workload, 50.0, arrivals))
    records = result.sent.records
    assert all(r.ok for r in records), [r.error for r in records]
    for record, due in zip(records, arrivals, strict=True):
        assert due - 1e-3 <= record.start_s < due + 0.25  # sent when due, not when the previous one finished
        assert record.request_id.startswith("cmpl-")  # the server's id: what its trace is filed under
    first_answer_ends = min(r.start_s + r.e2e_s for r in records)
    assert sum(r.start_s < first_answer_ends for r in records) >= 3  # a closed loop of one: exactly 1
    by_start = sorted(records, key=lambda r: r.start_s)
    assert by_start[-1].ttft_s > by_start[0].ttft_s  # the last waited behind the others
    assert result.queued_s is None  # no trace file given


def test_goodput_counts_only_requests_that_met_both_slos():
    slo = loadgen.Slo(ttft_s=0.5, itl_s=0.05)

    def record(index: int, ttft_s: float, itl_s: float | None) -> RequestRecord:
        return RequestRecord(index, start_s=0.0, ok=True, ttft_s=ttft_s, itl_s=itl_s, e2e_s=ttft_s + 1.0,
                             output_tokens=8, request_id=f"cmpl-{index}")

    records = [record(0, 0.2, 0.03),  # met both
               record(1, 0.6, 0.03),  # missed TTFT
               record(2, 0.2, 0.08),  # missed ITL
               record(3, 0.5, 0.05),  # exactly on both targets: met
               record(4, 0.1, None),  # one token, no gap: judged on TTFT alone, met
               RequestRecord(5, start_s=0.0, error="RuntimeError: HTTP 500")]  # failed: never met
    assert [slo.met_by(r) for r in records] == [True, False, False, True, True, False]
    sent = loadgen.Sent(wall_s=3.0, records=records, in_flight=InFlight("server", [(0.0, 2)]), engine_busy=0.5,
                        prefix_cache_hit_rate=None)
    queued = {"cmpl-0": 0.0, "cmpl-1": 0.4, "cmpl-2": 0.1, "cmpl-3": 0.3, "cmpl-4": 0.0}
    summary = loadgen.RateResult(2.0, [0.0] * 6, None, sent, queued).summary(slo)
    assert summary["goodput"] == pytest.approx(1.0)  # 3 requests met both, over 3 s
    assert summary["goodput_share"] == pytest.approx(0.5)  # 3 of 6
    assert summary["achieved_rate"] == pytest.approx(5 / 3) and summary["errors"] == 1
    assert summary["output_tokens_per_s"] == pytest.approx(40 / 3)
    assert summary["ttft_s"]["p50"] == pytest.approx(0.2) and summary["ttft_s"]["p90"] == pytest.approx(0.56)
    assert summary["queued_s"]["mean"] == pytest.approx(0.16) and summary["queued_s"]["p90"] == pytest.approx(0.36)
    assert loadgen.RateResult(2.0, [0.0] * 6, None, sent).summary(slo)["queued_s"] is None  # untraced
    assert loadgen.TailStats.of([float(v) for v in range(1, 11)]).p90 == pytest.approx(9.1)
    assert "goodput  1.00/s ( 50% met the SLOs)" in loadgen.format_rate_summary(summary)


def test_the_sustainable_rate_is_the_highest_whose_share_met_the_slos():
    summaries = [{"rate": 1.0, "goodput_share": 1.0}, {"rate": 2.0, "goodput_share": 0.95},
                 {"rate": 4.0, "goodput_share": 0.7}, {"rate": 8.0, "goodput_share": 0.2}]
    assert loadgen.sustainable_rate(summaries, 0.9) == 2.0
    assert loadgen.sustainable_rate(summaries, 0.96) == 1.0
    assert loadgen.sustainable_rate(summaries, 0.5) == 4.0
    assert loadgen.sustainable_rate(summaries[2:], 0.9) is None  # not even the lowest rate: none
    assert loadgen.sustainable_rate([], 0.9) is None


def test_queueing_time_comes_from_a_traced_stage_servers_queued_spans(engine02, tmp_path):
    # A preempted request waits twice: its queueing time is the sum, as the trace's totals give it.
    assert loadgen.queued_seconds([{"request_id": "a", "totals_ms": {"queued": 150.0, "prefill": 9.0}},
                                   {"request_id": "b", "totals_ms": {"prefill": 9.0}}]) == {"a": 0.15, "b": 0.0}
    path = tmp_path / "traces.jsonl"
    with serve_stage("02_streaming", engine02, tracer=Tracer(str(path))) as server:
        workload = loadgen.Workload(server.url, MODEL, max_tokens=8)
        result = asyncio.run(loadgen.run_rate(workload, 50.0, loadgen.arrival_times(50.0, 5, "fixed"),
                                              trace_file=path))
    records = sorted(result.sent.records, key=lambda r: r.start_s)
    assert all(r.ok for r in records) and set(result.queued_s) == {r.request_id for r in records}
    for record in records:  # the queue is part of what the client saw as its time to first token
        assert 0 <= result.queued_s[record.request_id] <= record.ttft_s + 0.01
    # One request at a time: the last to arrive waited for the others to be served.
    assert result.queued_s[records[-1].request_id] > result.queued_s[records[0].request_id] + 0.05
    summary = result.summary(loadgen.Slo(0.5, 0.05))["queued_s"]
    assert 0 <= summary["p50"] <= summary["p90"] <= summary["p99"]


def fake_rates_result(name: str, sustainable: float | None) -> dict:
    def stats(value: float) -> dict[str, float]:
        return {"mean": value, "p50": value, "p99": 2 * value, "p90": 1.5 * value}

    rates = [{"rate": r, "ttft_s": stats(0.1 * r), "itl_s": stats(0.03), "goodput_share": min(1.0, 1 / r)}
             for r in (0.5, 1.0, 2.0, 4.0)]
    return {"name": name, "model": MODEL, "device": "cpu", "dtype": "float32", "rates": rates,
            "sustainable_rate": sustainable, "slo": {"ttft_ms": 500.0, "itl_ms": 50.0, "share": 0.9},
            "workload": {"rates": [0.5, 1.0, 2.0, 4.0], "requests_per_rate": 8, "max_tokens": 16,
                         "arrivals": "poisson", "max_concurrency": None, "shared_prefix_tokens": 0}}


def test_open_loop_results_have_their_own_name_figure_and_comparison(tmp_path):
    args = bench.parse_args(["--stage", "04", "--request-rate", "0.5", "2"])
    rates = bench.rate_sweep_of(args)
    assert rates.rates == [0.5, 2.0] and rates.arrivals == "poisson" and rates.seed == 0
    assert rates.max_concurrency is None and rates.slo == loadgen.Slo(0.5, 0.05) and rates.slo_share == 0.9
    assert bench.rate_sweep_of(bench.parse_args(["--stage", "04"])) is None  # the closed loop, as before
    custom = bench.parse_args(["--stage", "04", "--request-rate", "1", "--arrivals", "fixed", "--seed", "3",
                               "--max-concurrency", "4", "--slo-ttft-ms", "2000", "--slo-itl-ms", "100"])
    assert bench.rate_sweep_of(custom) == bench.RateSweep([1.0], "fixed", 3, 4, loadgen.Slo(2.0, 0.1), 0.9)
    for wrong in (["--request-rate", "1", "--levels", "4"], ["--request-rate", "0"], ["--slo-share", "1.5"],
                  ["--request-rate", "1", "--max-concurrency", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--stage", "04", *wrong])
    # Closed and open results of the previous stage never stand in for each other.
    (tmp_path / "03_paged_kv_rates.json").write_text(json.dumps(fake_rates_result("03_paged_kv_rates", 1.0)))
    assert bench.previous_stage_result(tmp_path, "04") == []
    (tmp_path / "03_paged_kv.json").write_text(json.dumps(fake_result("03_paged_kv", True)))
    assert [p.name for p in bench.previous_stage_result(tmp_path, "04")] == ["03_paged_kv.json"]
    assert [p.name for p in bench.previous_stage_result(tmp_path, "04", rates=True)] == ["03_paged_kv_rates.json"]
    out = plots.plot_rates([fake_rates_result("03_paged_kv_rates", 1.0), fake_rates_result("04_rates", None)],
                           tmp_path / "rates.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert bench.sustainable_line(fake_rates_result("x", 2.0)).startswith("Sustainable rate: 2 requests/s")
    assert "none of the rates" in bench.sustainable_line(fake_rates_result("x", None))


def test_rescoring_judges_saved_records_against_other_targets_and_rewrites_files_and_figures(tmp_path, capsys):
    def rate(offered: float, itl_s: list[float]) -> dict:  # one request per ITL, each with a TTFT of 0.3 s
        records = [{**asdict(RequestRecord(i, start_s=0.0, ok=True, ttft_s=0.3, itl_s=gap, e2e_s=1.0,
                                           output_tokens=8)), "queued_s": 0.0} for i, gap in enumerate(itl_s)]
        return {**fake_rates_result("x", None)["rates"][0], "rate": offered, "wall_s": 2.0, "records": records,
                "goodput": 0.0, "goodput_share": 0.0}

    paths, saved = [], []
    for name, slow in (("04_rates", 0.2), ("05_rates", 0.12)):
        saved.append({**fake_rates_result(name, None), "rates": [rate(0.5, [0.08] * 10), rate(1.0, [0.08] * 9 + [slow]),
                                                                 rate(2.0, [slow] * 10)]})
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(saved[-1]))
    bench.main(["--rescore", *map(str, paths), "--slo-ttft-ms", "1000", "--slo-itl-ms", "100", "--slo-share", "0.9"])
    first = json.loads(paths[0].read_text())
    assert first["slo"]["itl_ms"] == 100.0 and first["slo"]["ttft_ms"] == 1000.0
    assert [r["goodput_share"] for r in first["rates"]] == [1.0, 0.9, 0.0]
    assert first["rates"][0]["goodput"] == pytest.approx(5.0)  # 10 requests met both, over 2 s
    assert first["sustainable_rate"] == 1.0 and first["rates"][2]["records"] == saved[0]["rates"][2]["records"]
    bench.main(["--rescore", str(paths[1]), "--slo-itl-ms", "150"])  # ITL 0.12 s now meets the target
    assert json.loads(paths[1].read_text())["sustainable_rate"] == 2.0
    assert all(path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC for path in paths)
    assert (tmp_path / "rates.png").read_bytes()[:8] == PNG_MAGIC  # several files: one figure of them all
    assert "04_rates: Sustainable rate: 1 requests/s" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="not an open loop"):
        bench.rescore(fake_result("closed", True), loadgen.Slo(1.0, 0.1), 0.9)


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
def test_bench_open_loop_end_to_end(tmp_path):
    command = [sys.executable, "-m", "common.bench", "--stage", "02", "--request-rate", "2", "4", "--requests", "6",
               "--max-tokens", "8", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]

    assert not (tmp_path / "02_streaming.json").exists()  # never the closed loop's file
    result = json.loads((tmp_path / "02_streaming_rates.json").read_text())
    assert result["name"] == "02_streaming_rates" and "--trace" in result["server_command"]
    assert result["workload"]["rates"] == [2.0, 4.0] and result["workload"]["arrivals"] == "poisson"
    assert result["slo"] == {"ttft_ms": 500.0, "itl_ms": 50.0, "share": 0.9,
                             "itl_is": "each request's mean gap between tokens"}
    assert result["queueing"].startswith("the server's traces")
    assert [rate["rate"] for rate in result["rates"]] == [2.0, 4.0]
    for rate in result["rates"]:
        assert rate["errors"] == 0 and len(rate["records"]) == 6 and rate["output_tokens"] == 48
        assert rate["arrivals_s"] == pytest.approx(loadgen.arrival_times(rate["rate"], 6), abs=1e-4)
        assert all(r["queued_s"] is not None for r in rate["records"])  # every request found in the traces
        assert rate["queued_s"]["p50"] <= rate["queued_s"]["p90"] and rate["in_flight"]["source"] == "server"
        assert 0 <= rate["goodput_share"] <= 1 and rate["ttft_s"]["p90"] <= rate["ttft_s"]["p99"]
    assert result["sustainable_rate"] == loadgen.sustainable_rate(result["rates"], 0.9)
    assert "Sustainable rate:" in run.stdout
    assert (tmp_path / "02_streaming_rates.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(httpx.ConnectError):  # the server is gone
        httpx.get(f"{result['url']}/health", timeout=2)


def test_bench_open_loop_against_an_outside_server_has_no_queueing_and_says_why(server02, tmp_path):
    bench.main(["--url", server02.url, "--model", MODEL, "--name", "outside", "--device", "cpu", "--request-rate",
                "20", "--requests", "2", "--max-tokens", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "outside_rates.json").read_text())
    assert result["queueing"].startswith("none: an outside server (--url)")
    [rate] = result["rates"]
    assert rate["queued_s"] is None and all(r["queued_s"] is None for r in rate["records"])
    assert rate["errors"] == 0 and rate["output_tokens"] == 4


# --- speculative decoding's benchmark (08_speculative/spec_bench.py) -------------------------------------------


def test_spec_bench_compares_every_configuration_with_stage_07_at_the_same_level_and_workload(tmp_path):
    spec_bench = stage("08_speculative", "spec_bench")
    configs = spec_bench.configurations("08", [2, 4], ["ngram", "draft"])
    assert [label for label, _, _ in configs] == ["07", "08 ngram k=2", "08 ngram k=4", "08 draft k=2", "08 draft k=4"]
    assert configs[2][2] == ["--speculative", "ngram", "--num-speculative-tokens", "4"]
    runs = [{"config": c, "workload": w, "concurrency": n, "output_tokens_per_s": tps}
            for c, w, n, tps in [("07", "chat", 1, 10.0), ("07", "chat", 4, 20.0), ("08 ngram k=2", "chat", 1, 15.0),
                                 ("08 ngram k=2", "chat", 4, 18.0), ("07", "extractive", 1, 8.0),
                                 ("08 ngram k=2", "extractive", 1, 20.0)]]
    spec_bench.speed_ups(runs)
    assert [r["speed_up"] for r in runs] == [1.0, 1.0, 1.5, 0.9, 1.0, 2.5]
    for r in runs:
        r["acceptance_rate"] = r["mean_accepted_length"] = None
    spec_bench.plot({"workloads": {"chat": [], "extractive": []}, "levels": [1, 4], "runs": runs}, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes().startswith(PNG_MAGIC)


def test_a_benchmark_measures_a_later_stage_named_by_its_number():
    """A harness lives only beside the lesson it measures; ``--stage NN`` loads stage NN's modules instead, so stage
    09's decode step is timed on stage 09's own engine and spec_bench compares stage 09 with stage 07."""
    step_bench = stage("07_cuda_graphs", "step_bench")
    engine, config, step_input = step_bench.stage_parts("09_tensor_parallel")
    assert (engine.__module__, config.__module__, step_input.__module__) == (
        "09_tensor_parallel.engine", "09_tensor_parallel.config", "09_tensor_parallel.model_runner")
    with pytest.raises(SystemExit, match="no static buffers"):  # stage 06 has no runner.sizes or run_eager
        step_bench.stage_parts("06_chunked_prefill")
    configs = stage("08_speculative", "spec_bench").configurations("09", [4], ["ngram"])
    assert configs == [("07", "07", []),
                       ("09 ngram k=4", "09", ["--speculative", "ngram", "--num-speculative-tokens", "4"])]


# --- make peer: the latest stage against transformers serve (common/peer.py) ----------------------------------


def test_peer_ratio_table_json_and_figure_from_two_results(tmp_path):
    """The comparison's pure part, from two hand-made results: no server starts (transformers serve is too slow
    to start for the suite)."""
    from common import peer

    theirs, ours = fake_result(peer.PEER_NAME, True), fake_result("09_tensor_parallel", True)
    for result, tps in ((theirs, [10.0, 30.0, 0.0]), (ours, [12.0, 45.0, 50.0])):
        result.update(streaming=True, quick=True, git_commit="abc", git_dirty=False)
        result["workload"]["max_tokens"] = 16
        for level, value in zip(result["levels"], tps, strict=True):
            level.update(output_tokens_per_s=value, requests=8, errors=0, output_tokens=8 * 16)
    ours["levels"].append({**ours["levels"][-1], "concurrency": 16})  # a level the peer lacks: left out
    theirs["levels"][0]["output_tokens"] = 100  # stopped early at concurrency 1: unequal work, said so

    rows = peer.ratio_rows(theirs, ours)
    assert [row["concurrency"] for row in rows] == [1, 4, 8]
    assert [row["ratio"] for row in rows] == [pytest.approx(1.2), pytest.approx(1.5), None]  # None: peer made 0
    table = peer.format_table(rows, "09_tensor_parallel").splitlines()
    assert table[0] == "| Concurrency | transformers tokens/s | 09_tensor_parallel tokens/s | 09 / transformers |"
    assert table[2:] == ["| 1 | 10.0 | 12.0 | 1.20x |", "| 4 | 30.0 | 45.0 | 1.50x |", "| 8 | 0.0 | 50.0 | n/a |"]

    commands = {"transformers_server": "transformers serve m --continuous-batching", "stage_bench": "python -m x"}
    result = peer.peer_result(theirs, ours, commands, machine={"cpu": "test"}, git={"git_commit": "def"})
    json_path, png_path = peer.write_peer(result, tmp_path / "cpu")
    assert (json_path.name, png_path.name) == ("peer.json", "peer.png")
    assert png_path.read_bytes()[:8] == PNG_MAGIC
    written = json.loads(json_path.read_text())
    assert written["results"] == {"transformers": theirs, "stage": ours}  # both whole, as bench writes them
    assert written["ratio"][:2] == [{"concurrency": 1, "transformers_tokens_per_s": 10.0, "stage_tokens_per_s": 12.0,
                                     "ratio": pytest.approx(1.2)},
                                    {"concurrency": 4, "transformers_tokens_per_s": 30.0, "stage_tokens_per_s": 45.0,
                                     "ratio": pytest.approx(1.5)}]
    assert (written["stage"], written["peer"], written["device"]) == ("09_tensor_parallel", peer.PEER_NAME, "cpu")
    assert written["machine"] == {"cpu": "test"} and written["git_commit"] == "def" and written["commands"] == commands
    assert written["date"] and written["warnings"] == [
        f"{peer.PEER_NAME} at concurrency 1: 100 output tokens, not 8 x 16"]


def test_peer_sends_the_same_greedy_exact_length_work_to_both_servers():
    from common import peer

    args = peer.parse_args(["--stage", "4", "--quick", "--levels", "1", "2", "--max-tokens", "8"])
    assert args.stage == "04" and args.quick
    assert peer.sweep_flags(args) == ["--quick", "--levels", "1", "2", "--max-tokens", "8"]
    # By default the latest single server: not the gateway's stage, a fleet of them.
    servers = [p.parent.name for p in REPO.glob("[0-9][0-9]_*/__main__.py") if not (p.parent / "gateway.py").exists()]
    assert peer.parse_args([]).stage == max(servers)[:2]
    # The peer refuses ignore_eos: it gets a generation config without an EOS id instead, greedy and streamed too.
    body = loadgen.Workload("http://x", "m", max_tokens=8, extra_body=peer.PEER_EXTRA_BODY).body(0)
    assert "ignore_eos" not in body and json.loads(body["generation_config"]) == {"eos_token_id": -1}
    assert body["temperature"] == 0 and body["stream"] and body["max_tokens"] == 8
    command = peer.serve_command(["transformers"], Path("/m"), "cpu", "float32", 8090, peer.CB_OPTIONS)
    assert command[:3] == ["transformers", "serve", "/m"] and "--continuous-batching" in command
    assert peer.module_missing_from_log("ModuleNotFoundError: No module named 'fastapi.responses'") == "fastapi"
    assert peer.module_missing_from_log("ImportError: Missing dependencies for serving. Install with "
                                        "`pip install transformers[serving]`") == "transformers[serving]"
    assert peer.module_missing_from_log("all fine") is None


def test_peer_says_in_one_line_what_transformers_serve_lacks(capsys):
    from common import peer

    with pytest.raises(SystemExit) as exit_info:
        peer.exit_needing(["fastapi", "uvicorn"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: transformers serve needs fastapi, uvicorn, not installed here: pip install fastapi uvicorn"]
    assert peer.missing_serve_modules() == []  # requirements.txt installs all it needs


def test_peer_runs_both_servers_in_the_dtype_asked_and_files_bfloat16_apart(tmp_path, monkeypatch):
    """--dtype reaches transformers serve, its sweep and the stage's server; the peer's default levels are 1, 4, 16,
    64; a bfloat16 result goes to peer_bf16.json beside float32's peer.json, and says its dtype. No server starts:
    the sweeps and the servers are stand-ins."""
    from contextlib import nullcontext

    from common import peer

    monkeypatch.delenv("QUICK", raising=False)
    args = peer.parse_args(["--stage", "4", "--dtype", "bfloat16"])
    assert args.dtype == "bfloat16" and args.levels == peer.PEER_LEVELS == [1, 4, 16, 64]
    assert peer.sweep_flags(args) == ["--levels", "1", "4", "16", "64"]
    assert peer.parse_args(["--stage", "4"]).dtype == "auto"  # the stage's default: float32 on a CPU
    assert peer.sweep_flags(peer.parse_args(["--stage", "4", "--quick"])) == ["--quick"]  # quick keeps its levels
    assert peer.sweep_flags(peer.parse_args(["--stage", "4", "--levels", "2", "8"])) == ["--levels", "2", "8"]
    with pytest.raises(SystemExit):
        peer.parse_args(["--stage", "4", "--dtype", "int8"])

    benched: list[argparse.Namespace] = []

    def fake_run(bench_args: argparse.Namespace, process_group: bool = False) -> dict:
        benched.append(bench_args)
        return {"name": bench_args.name, "server_command": "python -m 04_continuous_batching --dtype bfloat16"}

    monkeypatch.setattr(peer, "cb_options", lambda cli: ([], "none"))
    monkeypatch.setattr(bench, "stage_server", lambda *a, **k: nullcontext())
    monkeypatch.setattr(bench, "run", fake_run)
    commands: dict[str, str] = {}
    peer.measure_peer(args, Path("/m"), "cpu", "bfloat16", commands)
    peer.measure_stage(args, "cpu", "bfloat16", commands)
    assert "--dtype bfloat16" in commands["transformers_server"]
    assert [(a.dtype, a.levels) for a in benched] == [("bfloat16", [1, 4, 16, 64])] * 2
    assert benched[0].url and benched[1].stage == "04"

    assert [peer.result_stem(d) for d in ("float32", "bfloat16", "float16")] == ["peer", "peer_bf16", "peer_fp16"]
    monkeypatch.setattr(peer, "plot_peer", lambda result, out: Path(out))  # the figure is the first test's
    theirs, ours = fake_result(peer.PEER_NAME, True), fake_result("04_continuous_batching", True)
    for level in theirs["levels"] + ours["levels"]:
        level.update(requests=8, errors=0, output_tokens=8 * 16)
    written = {}
    for dtype in ("float32", "bfloat16"):
        theirs["dtype"] = ours["dtype"] = dtype
        json_path, png_path = peer.write_peer(peer.peer_result(theirs, ours, {}, {"cpu": "test"}, {}), tmp_path)
        written[dtype] = (json_path.name, png_path.name, json.loads(json_path.read_text())["dtype"])
    assert written == {"float32": ("peer.json", "peer.png", "float32"),
                       "bfloat16": ("peer_bf16.json", "peer_bf16.png", "bfloat16")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer.json", "peer_bf16.json"]  # neither overwrote


def test_machine_info_says_which_cpu_flags_bfloat16_and_int8_matmuls_need(tmp_path, monkeypatch):
    """cpu_flags: which of avx2, avx512f, avx512_bf16, amx_bf16, amx_tile, avx512_vnni, avx_vnni the first flags line
    of /proc/cpuinfo lists; None without the file. torch is a stand-in here: the test needs no import of it."""
    from types import SimpleNamespace

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\n"
                       "flags\t\t: fpu sse avx avx2 avx512f avx512_vnni amx_tile amx_bf16 avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu avx_vnni\n")
    assert bench.cpu_flags(cpuinfo) == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"]
    assert bench.cpu_flags(tmp_path / "missing") is None
    fake_torch = SimpleNamespace(__version__="0.test", cuda=SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    machine = bench.machine_info("cpu")
    if Path("/proc/cpuinfo").is_file():
        assert isinstance(machine["cpu_flags"], list) and set(machine["cpu_flags"]) <= set(bench.CPU_FLAGS)
    else:
        assert machine["cpu_flags"] is None
    assert machine["torch"] == "0.test"
