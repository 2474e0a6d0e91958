"""The mixed workload (common/mixed.py): long prompts that share no block, a short live run against stage 06
that records every chat gap and the long prompt's time to first token, and the measured window's arithmetic."""

from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from common.mixed import MixedRun, MixedWorkload, run_mixed
from common.plots import plot_mixed


def test_long_prompts_are_long_and_differ_from_their_first_block(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    workload = MixedWorkload()
    prompts = [tokenizer(workload.long_prompt(i)).input_ids for i in range(3)]
    assert all(1800 <= len(ids) <= 4400 for ids in prompts), [len(ids) for ids in prompts]
    assert len({tuple(ids[:16]) for ids in prompts}) == 3  # no prefix cache can share their first block
    assert workload.long_prompt(1) == MixedWorkload().long_prompt(1)  # seeded: the same run every time


def test_a_short_live_run_records_the_gaps_and_the_long_prompts_ttft(server06, tmp_path):
    workload = MixedWorkload(streams=2, stream_tokens=(8, 8), stream_stagger_s=0.1, long_prompts=1,
                             long_tokens=(100, 150), long_every_s=0.5, lead_in_s=0.3, long_max_tokens=4)
    run = MixedRun("06 test", "06", 64, "in-process")
    asyncio.run(run_mixed(server06.url, "smollm2-135m-instruct", workload, run))
    summary = run.summary()
    assert run.errors == 0 and len(run.long_ttfts) == 1 and run.long_ttfts[0][1] > 0
    assert len(run.chat_gaps) >= 7 and all(gap > 0 for _, gap in run.chat_gaps)  # one request: 8 tokens, 7 gaps
    begin, end = run.window
    assert begin == 0.3 and end > begin + run.long_ttfts[0][1]  # from the long prompt's arrival to its answer's end
    assert 4 <= run.window_tokens < sum(tokens for _, tokens in run.answers) and summary["output_tokens_per_s"] > 0
    itl = summary["chat_itl_s"]
    assert 0 < itl["p50"] <= itl["p99"] <= itl["max"]
    result = {"workload": {"streams": 2, "long_tokens": [100, 150], "long_every_s": 0.5}, "device": "cpu",
              "machine": {"cpu": "test"},
              "runs": [{**summary, "chat_gaps": run.chat_gaps, "long_ttfts": run.long_ttfts, "window": run.window},
                       {**summary, "label": "05 test", "budget": None, "chat_gaps": run.chat_gaps,
                        "long_ttfts": run.long_ttfts, "window": run.window}]}
    assert plot_mixed(result, tmp_path / "mixed.png").stat().st_size > 10_000


def test_the_window_counts_a_requests_tokens_where_its_chunks_arrived():
    run = MixedRun("by hand", "06", 64, "none", window=(2.0, 3.0))
    run.answers = [([1.0, 2.0, 3.0, 4.0], 8), ([2.5], 3), ([0.5, 1.5], 2)]  # half in, all in, none in
    run.chat_gaps = [(1.0, 0.1), (2.5, 0.2), (3.5, 0.4)]  # only the one at 2.5 s is in the window
    run.count_window_tokens()
    assert run.window_tokens == 8 * 2 / 4 + 3
    summary = run.summary()
    assert summary["output_tokens_per_s"] == 7.0 and summary["chat_itl_s"]["max"] == 0.2
