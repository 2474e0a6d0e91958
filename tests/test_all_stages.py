"""Every stage against Hugging Face, in one test: on the standard prompts (text and chat) each stage's
greedy tokens are exactly those of Hugging Face ``generate()`` on the same weights. LLMs-from-scratch
checks its model variants this way; here the variants are the stages (and, from stage 05 on, each of
a stage's on/off switches, listed in VARIANTS). The references are computed once and kept on disk.
Then every stage's own command line, started as a user starts it, serves a request."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from common import bench
from common.net import free_port

from .conftest import make_engine, stage
from .prompts import CHAT_PROMPTS, TEXT_PROMPTS
from .stages import STAGES, has

MAX_TOKENS = 32


def greedy_tokens(folder: str, engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens through the stage's own offline API (its shape changes with the lesson)."""
    params = stage(folder, "sampler").SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    if has(folder, "batching"):  # 04 on: every prompt in one continuous batch
        return engine.generate_offline(prompts, params)
    if has(folder, "streaming"):  # 02 and 03: a generator of outputs per request
        return [[t for output in engine.generate(f"all-{i}", ids, params) for t in output.token_ids]
                for i, ids in enumerate(prompts)]
    return [engine.generate(ids, params).output_ids for ids in prompts]  # 01: the whole answer


# Each stage's on/off switches (EngineConfig fields) that must not change a greedy answer. The default
# configuration ({}) always runs; a stage adds its switches here, e.g. stage 05 {"prefix_cache": "off"}.
VARIANTS: dict[str, list[dict]] = {folder: [{}] for folder in STAGES}
VARIANTS["05_prefix_cache"] += [{"prefix_cache": "off"}, {"prefix_cache": "radix"}]
# Budgets that cut every prompt into chunks at odd places (the budget holds max_num_seqs decodes at least).
VARIANTS["06_chunked_prefill"] += [{"max_num_batched_tokens": n, "max_num_seqs": 4} for n in (7, 16, 33)]
# Buckets of 1, 2, 4 and 7: a batch of 3, 5 or 6 sequences pads to the next one with rows that do nothing.
VARIANTS["07_cuda_graphs"] += [{"max_num_seqs": 7}]
# The default guesses with n-grams (k = 4); a layer-skip draft guesses badly, so most of its runs are cut short.
VARIANTS["08_speculative"] += [{"speculative": "draft", "num_speculative_tokens": 3}]
CASES = [(folder, variant) for folder in STAGES for variant in VARIANTS[folder]]

# On a GPU (the cuda mark: `pytest -m cuda`), every stage in float32, its pool (stage 03 on) a fixed size so
# that the engines of one session fit side by side. The GPU sums in another order than the CPU that made
# the reference, so a genuine near-tie may flip: accepted only where Hugging Face gives the two tokens
# logprobs within GPU_MARGIN of each other (vLLM's check_logprobs_close rule), and the comparison stops there.
GPU_MARGIN = 1e-3  # nats: float32 logits differ by about 1e-5 between the two machines
GPU_CASES = [pytest.param(folder, {"device": "cuda", **({"kv_cache_mb": 256} if has(folder, "paged_kv") else {})},
                          marks=pytest.mark.cuda, id=f"{folder}-cuda") for folder in STAGES]
# The overlapping engine's two switches on the GPU, where its launch-ahead and placeholders run on a real stream:
# speculation off (every step may overlap; the default's guesses make most steps wait) and overlap disabled.
OVERLAP_SWITCHES = {"speculative-off": {"speculative": "off"}, "disable-overlap": {"disable_overlap": True}}
GPU_CASES += [pytest.param(folder, {"device": "cuda", "kv_cache_mb": 256, **switch}, marks=pytest.mark.cuda,
                           id=f"{folder}-cuda-{name}")
              for folder in STAGES if has(folder, "overlap") and not has(folder, "gateway")
              for name, switch in OVERLAP_SWITCHES.items()]


CPU_CASES = [pytest.param(folder, variant, id=f"{folder}{'-' + str(variant) if variant else ''}")
             for folder, variant in CASES]


@pytest.mark.parametrize(("folder", "variant"), [*CPU_CASES, *GPU_CASES])
def test_every_stage_gives_hugging_faces_greedy_tokens(request, folder, variant, hf_greedy, hf_next_logprobs,
                                                       model_dir):
    if variant:
        engine = make_engine(folder, model_dir, **variant)
    else:
        engine = request.getfixturevalue(f"engine{folder[:2]}")  # the session's engine, default settings
    prompts = [engine.encode(p) for p in TEXT_PROMPTS]
    prompts += [engine.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    ours = greedy_tokens(folder, engine, prompts)
    for ids, tokens in zip(prompts, ours, strict=True):
        theirs = hf_greedy(ids, MAX_TOKENS)
        if variant.get("device") != "cuda":
            assert tokens == theirs, engine.tokenizer.decode(ids)
            continue
        flip = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)) if a != b), None)
        if flip is not None:
            logprobs = hf_next_logprobs(ids + theirs[:flip])
            gap = abs(float(logprobs[tokens[flip]] - logprobs[theirs[flip]]))
            assert gap <= GPU_MARGIN, f"token {flip} of {engine.tokenizer.decode(ids)!r}: a flip {gap:.2g} nats apart"


# bfloat16, on the latest engine: Hugging Face's model in bfloat16 on the same weights is the reference. Two
# bfloat16 computations that sum in different orders (ours computes attention in float32 on a CPU and blocks its
# matrix products its own way) differ by a few units in the last place of bfloat16, and greedy answers in
# bfloat16 meet exact ties often: a flip is accepted only where Hugging Face gives the two tokens logprobs within
# BF16_MARGIN of each other (vLLM's check_logprobs_close rule), and the comparison stops there. Its logits are
# bfloat16 numbers: between 16 and 32 one step of bfloat16 (8 bits of mantissa) is 0.125. Measured on the standard
# prompts: 5 of 6 answers flip, at gaps of 0, 0.125, 0.16, 0.25 and 0.25, and Hugging Face's own model disagrees
# with itself by as much (its cached generate() against one forward pass over the same tokens).
BF16_MARGIN = 0.5  # nats: four steps of bfloat16 at the top logits' scale
LATEST_ENGINE = [folder for folder in STAGES if not has(folder, "gateway")][-1]


def test_the_latest_engine_in_bfloat16_gives_hugging_faces_bfloat16_greedy_tokens(hf_greedy_bf16, hf_next_logprobs,
                                                                                  model_dir):
    engine = make_engine(LATEST_ENGINE, model_dir, dtype="bfloat16")
    prompts = [engine.encode(p) for p in TEXT_PROMPTS]
    prompts += [engine.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    for ids, tokens in zip(prompts, greedy_tokens(LATEST_ENGINE, engine, prompts), strict=True):
        theirs = hf_greedy_bf16(ids, MAX_TOKENS)
        flip = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)) if a != b), None)
        if flip is None:
            assert tokens == theirs, engine.tokenizer.decode(ids)  # and neither ends sooner
            continue
        logprobs = hf_next_logprobs(ids + theirs[:flip], torch.bfloat16)
        gap = abs(float(logprobs[tokens[flip]] - logprobs[theirs[flip]]))
        assert gap <= BF16_MARGIN, f"token {flip} of {engine.tokenizer.decode(ids)!r}: a flip {gap:.2g} nats apart"


@pytest.fixture(scope="module")
def hf_bf16_cuda(model_dir: Path):
    """Hugging Face's model in bfloat16 on the GPU: the bfloat16 reference computed where the engine runs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True)
    return model.to("cuda").eval()


@pytest.mark.cuda
def test_the_latest_engine_in_bfloat16_on_a_gpu_gives_hugging_faces_bfloat16_tokens_on_the_gpu(hf_bf16_cuda,
                                                                                             model_dir):
    """The bfloat16 rule above, both sides on the GPU: the kernels (Triton's attention, the fused norms, the graphs)
    against Hugging Face's own bfloat16 there, a flip accepted only at a near-tie of BF16_MARGIN."""
    engine = make_engine(LATEST_ENGINE, model_dir, device="cuda", dtype="bfloat16", kv_cache_mb=256)
    prompts = [engine.encode(p) for p in TEXT_PROMPTS]
    prompts += [engine.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    for ids, tokens in zip(prompts, greedy_tokens(LATEST_ENGINE, engine, prompts), strict=True):
        x = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            theirs = hf_bf16_cuda.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                                           do_sample=False)[0, len(ids):].tolist()
        flip = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=False)) if a != b), None)
        if flip is None:
            assert tokens == theirs, engine.tokenizer.decode(ids)  # and neither ends sooner
            continue
        with torch.inference_mode():
            logits = hf_bf16_cuda(torch.tensor([ids + theirs[:flip]], device="cuda")).logits[0, -1]
        logprobs = logits.float().log_softmax(-1)
        gap = abs(float(logprobs[tokens[flip]] - logprobs[theirs[flip]]))
        assert gap <= BF16_MARGIN, f"token {flip} of {engine.tokenizer.decode(ids)!r}: a flip {gap:.2g} nats apart"


@pytest.fixture(scope="module")
def tiny_folder(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the course model's tokenizer: a server process starts in the time of its imports."""
    from .test_model import copy_tokenizer, save_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny_cli")
    save_tiny_checkpoint("llama", folder)
    copy_tokenizer(model_dir, folder)
    return folder


# Stage 12's command line starts a Ray fleet: test_12_gateway starts one and tests it.
@pytest.mark.parametrize("folder", [folder for folder in STAGES if not has(folder, "gateway")])
def test_every_stage_serves_from_its_command_line(folder, tiny_folder):
    """``python -m NN_name --model M --port P``, as `make serve` and the benchmarks start it: healthy, it answers a
    completion (token ids below the tiny model's vocabulary), and it is gone once stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = bench.stage_command(folder[:2], port, str(tiny_folder), "cpu", "float32")
    with bench.stage_server(command, url):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0},
                              timeout=120)
        assert response.status_code == 200, response.text
        assert 1 <= response.json()["usage"]["completion_tokens"] <= 4
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
