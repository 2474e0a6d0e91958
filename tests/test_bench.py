"""The benchmark harness: the load generator against live stages 01 and 02, its aggregate math,
the figure, and `python -m common.bench` end to end (it must leave no server behind)."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from common import bench, loadgen, plots
from common.loadgen import InFlight, LevelResult, RequestRecord

from .conftest import REPO

MODEL = "smollm2-135m-instruct"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_level(url: str, *, stream: bool, concurrency: int, num_requests: int, max_tokens: int) -> LevelResult:
    workload = loadgen.Workload(url, MODEL, max_tokens=max_tokens, stream=stream)
    return asyncio.run(loadgen.run_level(workload, concurrency, num_requests))


def test_loadgen_streams_against_stage_02(server02):
    assert asyncio.run(loadgen.probe_streaming(server02.url, MODEL))
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
    assert loadgen.parse_counter(busy, loadgen.BUSY_METRIC) == 12.5
    assert loadgen.parse_counter(page, loadgen.BUSY_METRIC) is None


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
