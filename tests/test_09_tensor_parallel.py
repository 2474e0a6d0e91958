"""Stage 09: tensor parallelism. Each parallel layer, and each column/row pair, against its unsharded original (the
ranks simulated in this process), then real ranks: logits and greedy tokens at N = 2 and 3 against N = 1 and Hugging
Face, one rank in a process group of its own, a worker serving the steps rank 0 broadcasts, starting up (a worker
that exits first, a rank slow to load), the server on two ranks, and every way a rank can go away, with no process
left behind (and a GPU's waits, pretended on the CPU).

Tolerance. Split across ranks, a row-parallel layer's output is the sum of N partial products, each a sum
over 1/N of the input features, added by the all-reduce: the same numbers as one rank's matrix product,
summed in another order. float32 rounds each sum differently, by about 1e-7 of its size, and 30 layers carry
it on: logits of size ~20 move by up to ~1e-4 (measured: 2e-6 on the tiny models, 5e-5 on SmolLM2 at N = 3).
The tests allow 1e-3 on logits, and greedy tokens must be exactly Hugging Face's on the standard prompts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import torch
import torch.nn.functional as F
from openai import OpenAI
from torch import nn

from .conftest import make_engine, serve_stage, stage
from .prompts import CHAT_PROMPTS, TEXT_PROMPTS
from .servers import free_port, wait_healthy

FOLDER = "09_tensor_parallel"
distributed = stage(FOLDER, "distributed")
parallel = stage(FOLDER, "parallel")
model_module = stage(FOLDER, "model")
model_runner = stage(FOLDER, "model_runner")
sampler = stage(FOLDER, "sampler")

LOGITS_ATOL = 1e-3  # see the module docstring


@dataclass(frozen=True)
class SimulatedRank(distributed.TPGroup):
    """Rank ``rank`` of ``size``, all in this process, for the layers' math: its all-reduce records what it was
    given and returns it unchanged; the test sums the ranks' outputs itself (what the all-reduce would do)."""

    reduced: list = field(default_factory=list)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced.append(x)
        return x


def simulated(size: int) -> list[SimulatedRank]:
    return [SimulatedRank(rank=rank, size=size) for rank in range(size)]


# --- the parallel layers, rank by rank ----------------------------------------------------------------------


@pytest.mark.exercise("9.1")
@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(9, 3, 3), (4, 2, 2), (4, 4, 2), (4, 2, 4), (32, 8, 16),
                                                         (8, 1, 4)], ids=str)
def test_head_shards_give_each_rank_its_query_heads_and_the_kv_heads_they_read(heads, kv_heads, size):
    head_dim = 8
    group = heads // kv_heads  # query heads per KV head
    q_rows, kv_rows = [], []
    for tp in simulated(size):
        q, kv = parallel.head_shards(heads, kv_heads, head_dim, tp)
        assert (q.dim, kv.dim) == (0, 0)
        assert q.size == heads // size * head_dim
        assert kv.size == max(1, kv_heads // size) * head_dim  # split, or one replicated head
        assert q.start % head_dim == 0 and kv.start % head_dim == 0  # whole heads
        q_heads = range(q.start // head_dim, q.stop // head_dim)
        kv_heads_held = range(kv.start // head_dim, kv.stop // head_dim)
        assert all(h // group in kv_heads_held for h in q_heads), f"rank {tp.rank}: a query head without its KV head"
        q_rows += range(q.start, q.stop)
        kv_rows += range(kv.start, kv.stop)
    assert q_rows == list(range(heads * head_dim))  # the query heads, each on one rank, in order
    assert set(kv_rows) == set(range(kv_heads * head_dim))  # every KV head somewhere
    assert len(kv_rows) == max(kv_heads, size) * head_dim  # each on one rank, or replicated on size / kv_heads


def test_a_column_parallel_layer_is_the_full_layer_cut_by_output_features():
    torch.manual_seed(0)
    full, x = nn.Linear(16, 12), torch.randn(5, 16)
    for size in (2, 3):
        parts = []
        for tp in simulated(size):
            shard = parallel.even_shard(12, tp)
            layer = parallel.ColumnParallelLinear(16, [shard], bias=True)
            layer.load_state_dict({"weight": full.weight[shard.index()], "bias": full.bias[shard.index()]})
            parts.append(layer(x))
            assert not tp.reduced  # no communication
        torch.testing.assert_close(torch.cat(parts, dim=-1), full(x))


def test_a_stacked_column_parallel_layer_gives_each_rank_its_rows_of_every_part():
    torch.manual_seed(0)
    gate, up, x = nn.Linear(16, 12), nn.Linear(16, 12), torch.randn(5, 16)
    for tp in simulated(2):
        shard = parallel.even_shard(12, tp)
        layer = parallel.ColumnParallelLinear(16, [shard, shard], bias=True)
        layer.load_state_dict({"weight": torch.cat([gate.weight[shard.index()], up.weight[shard.index()]]),
                               "bias": torch.cat([gate.bias[shard.index()], up.bias[shard.index()]])})
        mine_of_gate, mine_of_up = layer(x).chunk(2, dim=-1)  # [5, 6] each: this rank's features of both
        torch.testing.assert_close(mine_of_gate, gate(x)[:, shard.start : shard.stop])
        torch.testing.assert_close(mine_of_up, up(x)[:, shard.start : shard.stop])


@pytest.mark.exercise("9.2")
@pytest.mark.parametrize("size", [2, 3])
def test_a_row_parallel_layer_sums_to_the_full_layer_with_its_bias_added_once(size):
    torch.manual_seed(0)
    full, x = nn.Linear(12, 16), torch.randn(5, 12)
    nn.init.normal_(full.bias, std=1.0)  # a bias added N times instead of once would show
    total = torch.zeros(5, 16)
    for tp in simulated(size):
        columns = parallel.even_shard(12, tp, dim=1)
        layer = parallel.RowParallelLinear(columns, 16, bias=True, tp=tp)
        layer.load_state_dict({"weight": full.weight[columns.index()], "bias": full.bias})
        out = layer(x[:, columns.start:columns.stop])  # this rank's slice of the input
        assert len(tp.reduced) == 1 and tp.reduced[0] is out, "the partial product goes through one all-reduce"
        total += out
    torch.testing.assert_close(total, full(x))


@pytest.mark.exercise("9.3")
@pytest.mark.parametrize("size", [2, 3])
def test_the_vocabulary_parallel_embedding_finds_each_token_on_exactly_one_rank(size):
    torch.manual_seed(0)
    vocab, hidden = 12, 4
    weight, ids = torch.randn(vocab, hidden), torch.tensor([0, 11, 5, 4, 3, 8, 7, 0, 6])
    total = torch.zeros(len(ids), hidden)
    for tp in simulated(size):
        layer = parallel.VocabParallelEmbedding(vocab, hidden, tp)
        layer.load_state_dict({"weight": weight[layer.rows.index()]})
        out = layer(ids)
        mine = (ids >= layer.rows.start) & (ids < layer.rows.stop)
        assert torch.equal(out[mine], weight[ids[mine]])
        assert torch.all(out[~mine] == 0), "another rank's tokens must contribute zeros"
        assert len(tp.reduced) == 1, "the rows go through one all-reduce"
        total += out
    torch.testing.assert_close(total, F.embedding(ids, weight))


@pytest.mark.exercise("9.4")
def test_the_sizes_a_model_splits_across(model_dir):
    smollm2 = model_module.ModelConfig.from_pretrained(model_dir)  # 9 query heads, 3 KV heads
    assert smollm2.tensor_parallel_sizes() == [1, 3]
    tiny = model_module.ModelConfig.from_hf({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                                             "intermediate_size": 128, "num_hidden_layers": 2,
                                             "num_attention_heads": 4, "num_key_value_heads": 2,
                                             "rms_norm_eps": 1e-5, "max_position_embeddings": 256})
    assert tiny.tensor_parallel_sizes() == [1, 2, 4]  # 4 ranks: each KV head on two of them
    # Llama 3 8B's shapes: 32 query heads, 8 KV heads, 14,336 MLP features, a vocabulary of 128,256.
    llama3 = model_module.ModelConfig.from_hf({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                                               "intermediate_size": 14336, "num_hidden_layers": 32,
                                               "num_attention_heads": 32, "num_key_value_heads": 8,
                                               "rms_norm_eps": 1e-5, "max_position_embeddings": 8192})
    assert llama3.tensor_parallel_sizes() == [1, 2, 4, 8, 16, 32]
    odd = model_module.ModelConfig.from_hf({"model_type": "llama", "vocab_size": 256, "hidden_size": 48,
                                            "intermediate_size": 96, "num_hidden_layers": 2,
                                            "num_attention_heads": 6, "num_key_value_heads": 2,
                                            "rms_norm_eps": 1e-5, "max_position_embeddings": 256})
    # 3 divides the 6 query heads, but neither divides the 2 KV heads nor is a multiple of them; 6 does not divide
    # the vocabulary of 256.
    assert odd.tensor_parallel_sizes() == [1, 2]
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not split .* use one of 1, 3$"):
        smollm2.check_tensor_parallel_size(2)


def cut(layer: nn.Module, checkpoint: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A parallel layer's parameters cut from whole tensors as ``from_pretrained`` cuts them: each parameter's slices
    (``layer.shards``) of the checkpoint tensors it stacks, one after the other; a parameter with no shards, whole."""
    state = {}
    for name in layer.state_dict():
        parts, shards = checkpoint[name], layer.shards.get(name)
        assert len(parts) == (1 if shards is None else len(shards)), (
            f"a {type(layer).__name__} holds its {name} in {1 if shards is None else len(shards)} part(s), not in the "
            f"{len(parts)} checkpoint tensors this layer of the pair stacks")
        state[name] = parts[0] if shards is None else torch.cat([whole[shard.index()]
                                                                 for whole, shard in zip(parts, shards, strict=True)])
    return state


@pytest.mark.exercise("9.5")
@pytest.mark.parametrize("size", [2, 3])
def test_the_mlp_pair_split_across_ranks_sums_to_the_whole_mlp_with_one_all_reduce(size):
    """gate/up, SwiGLU on each rank's own features, then down: every rank runs its pair on the same whole input, the
    test adds their outputs (the all-reduce's sum), and the total is the unsplit MLP's."""
    torch.manual_seed(0)
    hidden, features, x = 8, 12, torch.randn(5, 8)
    gate, up, down = nn.Linear(hidden, features), nn.Linear(hidden, features), nn.Linear(features, hidden)
    nn.init.normal_(down.bias, std=1.0)
    total = torch.zeros(5, hidden)
    for tp in simulated(size):
        rows = parallel.even_shard(features, tp)  # this rank's features
        first, second = parallel.column_row_pair(hidden, [rows, rows], (True, True), tp)
        first.load_state_dict(cut(first, {"weight": [gate.weight, up.weight], "bias": [gate.bias, up.bias]}))
        second.load_state_dict(cut(second, {"weight": [down.weight], "bias": [down.bias]}))
        mine_of_gate, mine_of_up = first(x).chunk(2, dim=-1)  # [5, 12 / N] each
        assert not tp.reduced, "the first layer of the pair needs no communication"
        total += second(F.silu(mine_of_gate) * mine_of_up)  # [5, 8]: this rank's part of the sum
        assert len(tp.reduced) == 1, "the pair costs one all-reduce"
    torch.testing.assert_close(total, down(F.silu(gate(x)) * up(x)))


def causal_attention(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Each query head's causal attention over the KV head it reads: [T, (H + 2 Hkv) D] -> [T, H D]."""
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.unflatten(-1, (heads, head_dim)).transpose(0, 1)  # [H, T, D]
    k, v = (t.unflatten(-1, (kv_heads, head_dim)).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
            for t in (k, v))  # [H, T, D]: each query head's KV head
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).flatten(1)  # [T, H D]


@pytest.mark.exercise("9.5")
def test_the_attention_pair_split_by_heads_sums_to_the_whole_attention_with_one_all_reduce():
    """q/k/v (with biases, as Qwen2's), attention on each rank's own heads (4 query heads reading 2 KV heads: one KV
    head and its two query heads per rank), then o_proj: the ranks' outputs add up to the unsplit attention's."""
    torch.manual_seed(0)
    hidden, heads, kv_heads, head_dim, x = 16, 4, 2, 4, torch.randn(6, 16)
    q, k, v = (nn.Linear(hidden, n * head_dim) for n in (heads, kv_heads, kv_heads))
    o = nn.Linear(heads * head_dim, hidden)
    nn.init.normal_(o.bias, std=1.0)
    total = torch.zeros(6, hidden)
    for tp in simulated(2):
        q_rows, kv_rows = parallel.even_shard(heads * head_dim, tp), parallel.even_shard(kv_heads * head_dim, tp)
        first, second = parallel.column_row_pair(hidden, [q_rows, kv_rows, kv_rows], (True, True), tp)
        first.load_state_dict(cut(first, {"weight": [q.weight, k.weight, v.weight], "bias": [q.bias, k.bias, v.bias]}))
        second.load_state_dict(cut(second, {"weight": [o.weight], "bias": [o.bias]}))
        mine = causal_attention(first(x), heads // 2, kv_heads // 2, head_dim)  # [6, 8]: this rank's two heads
        assert not tp.reduced, "the first layer of the pair needs no communication"
        total += second(mine)  # [6, 16]: this rank's part of the sum
        assert len(tp.reduced) == 1, "the pair costs one all-reduce"
    whole = torch.cat([q(x), k(x), v(x)], dim=-1)
    torch.testing.assert_close(total, o(causal_attention(whole, heads, kv_heads, head_dim)))


@pytest.fixture(scope="module")
def tiny(model_dir, tmp_path_factory):
    """Tiny random checkpoints with the course model's tokenizer: {kind: folder}. A Llama (4 heads, 2 KV heads, tied
    embeddings), a Qwen2 (q/k/v biases), and a Llama with every bias and an untied head."""
    from .test_model import copy_tokenizer, save_tiny_checkpoint

    folders = {}
    for kind in ("llama", "qwen2", "llama_untied_bias"):
        folder = folders[kind] = tmp_path_factory.mktemp(f"tiny_tp_{kind}")
        save_tiny_checkpoint(kind, folder)
        copy_tokenizer(model_dir, folder)
    return folders


def test_each_rank_loads_only_its_own_slices(tiny):
    folder = tiny["llama_untied_bias"]
    cpu = torch.device("cpu")
    full = model_module.LlamaForCausalLM.from_pretrained(folder, torch.float32, cpu)
    checkpoint = model_module.load_safetensors(folder, torch.float32, cpu)  # every tensor whole, by its own name
    for tp in simulated(2):
        rank = model_module.LlamaForCausalLM.from_pretrained(folder, torch.float32, cpu, tp)
        shards = rank.weight_shards()  # by checkpoint name: q_proj, k_proj, ... not the stacked qkv_proj
        assert "model.layers.0.self_attn.o_proj.bias" not in shards  # a row-parallel bias is whole on every rank
        assert "model.layers.0.self_attn.k_proj.weight" in shards
        for name, parameter in rank.named_parameters():
            parts = model_module.checkpoint_parts(name)  # qkv_proj: this rank's rows of q, then of k, then of v
            expected = torch.cat([checkpoint[part][shards[part].index()] if part in shards else checkpoint[part]
                                  for part in parts])
            assert torch.equal(parameter, expected), name
        # Everything but the norms and the row-parallel biases is split in two.
        replicated = sum(p.numel() * 4 for name, p in rank.named_parameters()
                         if not any(part in shards for part in model_module.checkpoint_parts(name)))
        assert rank.num_weight_bytes - replicated == (full.num_weight_bytes - replicated) // 2


# --- real ranks: the same answers as one --------------------------------------------------------------------


def prompt_logits(engine, prompt_ids: list[int]) -> torch.Tensor:
    """The logits of every position of a prompt, computed in one step through the engine's runner (and so, with
    several ranks, through every rank). Uses the pool's first blocks, which a fresh engine has not given out."""
    n, block_size = len(prompt_ids), engine.config.block_size
    blocks = list(range(-(-n // block_size)))
    slots = [blocks[i // block_size] * block_size + i % block_size for i in range(n)]
    step = model_runner.StepInput(prompt_ids, list(range(n)), slots, [0, n], [n], [blocks], list(range(n)), [], [0])
    engine.ranks.send(step)  # every other rank runs the same step
    logits, _ = engine.runner.execute(step)
    return logits


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_stopped(pids: list[int], within_s: float = 15.0) -> None:
    """Every process in ``pids`` has exited (a zombie is gone too: reaped by its parent)."""
    deadline = time.monotonic() + within_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if running(pid)]
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_ranks_give_the_logits_and_tokens_of_one(tiny, kind):
    prompt = [(7 * i + 3) % 256 for i in range(40)]
    params = sampler.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = make_engine(FOLDER, tiny[kind], kv_cache_mb=4)
    expected_logits, expected_tokens = prompt_logits(one, prompt), one.generate_offline([prompt, prompt[:17]], params)
    two = make_engine(FOLDER, tiny[kind], kv_cache_mb=4, tensor_parallel_size=2)
    try:
        workers = [worker.pid for worker in two.ranks.workers]
        assert len(workers) == 1 and two.tp.size == 2
        # Each rank holds half the KV heads, so the same megabytes hold twice the blocks (the smallest over ranks).
        assert two.kv_cache.shape.num_kv_heads == 1 and two.kv_cache.num_blocks == 2 * one.kv_cache.num_blocks
        torch.testing.assert_close(prompt_logits(two, prompt), expected_logits, atol=LOGITS_ATOL, rtol=0)
        assert two.generate_offline([prompt, prompt[:17]], params) == expected_tokens
    finally:
        two.shutdown()
    assert_all_stopped(workers)


@pytest.fixture
def engine09_three_ranks(model_dir):
    """SmolLM2-135M on three ranks, for one test: a process holds one process group at a time, so every
    multi-rank engine is shut down before the next test starts another."""
    engine = make_engine(FOLDER, model_dir, kv_cache_mb=32, tensor_parallel_size=3)
    yield engine
    engine.shutdown()


def test_three_ranks_of_the_course_model_match_one_and_hugging_face(engine09_three_ranks, engine09, hf_greedy):
    """SmolLM2-135M split three ways (3 query heads and 1 KV head per rank): the logits of one rank within
    LOGITS_ATOL, the greedy tokens of Hugging Face exactly, on the standard prompts in one batch."""
    three = engine09_three_ranks
    assert three.model.num_weight_bytes < engine09.model.num_weight_bytes / 3 * 1.01  # a third each
    prompt = three.encode_chat([{"role": "user", "content": CHAT_PROMPTS[1]}])
    torch.testing.assert_close(prompt_logits(three, prompt), prompt_logits(engine09, prompt), atol=LOGITS_ATOL,
                               rtol=0)
    prompts = [three.encode(p) for p in TEXT_PROMPTS] + [three.encode_chat([{"role": "user", "content": p}])
                                                         for p in CHAT_PROMPTS]
    answers = three.generate_offline(prompts, sampler.SamplingParams(max_tokens=32, temperature=0.0))
    for ids, tokens in zip(prompts, answers, strict=True):
        assert tokens == hf_greedy(ids, 32), three.tokenizer.decode(ids)


def test_refused_at_start_up_before_any_process_starts(model_dir):
    children = psutil.Process().children()
    with pytest.raises(ValueError, match="use one of 1, 3"):
        make_engine(FOLDER, model_dir, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--speculative draft"):
        make_engine(FOLDER, model_dir, tensor_parallel_size=3, speculative="draft")
    assert psutil.Process().children() == children


def test_more_ranks_than_gpus_are_refused_before_any_process_starts(model_dir, monkeypatch):
    """On CUDA, rank r of a spawned engine runs on cuda:r. Here a CPU pretends to be a machine with one GPU: the
    check must refuse N = 3 in one line (without it, the workers fail at set_device(1) and rank 0 waits for
    them); torchrun, which gives each of its processes a GPU of its own, is not refused."""
    engine = stage(FOLDER, "engine")
    config = stage(FOLDER, "config").EngineConfig(model=str(model_dir), tensor_parallel_size=3)
    smollm2 = model_module.ModelConfig.from_pretrained(model_dir)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="needs a GPU per rank, and this machine has 1"):
        engine.check_tensor_parallel(config, smollm2, torch.device("cuda"))
    engine.check_tensor_parallel(config, smollm2, torch.device("cpu"))  # ranks on a CPU: processes, any number
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    engine.check_tensor_parallel(config, smollm2, torch.device("cuda"))


def test_the_demo_compares_only_with_an_engine_this_machine_can_run():
    main = stage(FOLDER, "__main__")
    assert main.comparison_size([1, 3], size=3, gpus=1) == 1  # beside a split engine: one rank
    assert main.comparison_size([1, 3], size=1, gpus=None) == 3  # on a CPU, any split
    assert main.comparison_size([1, 3], size=1, gpus=3) == 3
    assert main.comparison_size([1, 3], size=1, gpus=1) is None  # one GPU: no split to compare with
    assert main.comparison_size([1, 2, 4], size=1, gpus=2) == 2


def test_the_demo_stops_and_frees_each_engine_before_it_starts_the_next(model_dir, monkeypatch):
    """On a GPU the first engine's pool holds most of the memory (--gpu-memory-utilization), and the second engine's
    rank 0 runs on the same GPU: the demo must shut the first engine down and let go of it (nothing left referring to
    it, so that its memory can be freed) before it builds the second. Engines that only record their lives here."""
    main = stage(FOLDER, "__main__")
    events, alive, in_memory = [], weakref.WeakSet(), []

    class RecordingEngine:
        def __init__(self, config) -> None:
            in_memory.append(len(alive))  # engines not yet freed when this one starts
            alive.add(self)
            events.append(("start", config.tensor_parallel_size))
            self.config, self.device = config, torch.device("cpu")
            self.tp = SimpleNamespace(size=config.tensor_parallel_size, group=None)
            self.model = SimpleNamespace(config=SimpleNamespace(tensor_parallel_sizes=lambda: [1, 3]))
            self.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "answer")

        def encode_chat(self, messages) -> list[int]:
            return [1, 2, 3]

        def generate_offline(self, prompts, params) -> list[list[int]]:
            return [[7, 8] for _ in prompts]

        def memory_report(self) -> str:
            return f"rank 0 of {self.tp.size}"

        def shutdown(self, graceful: bool = True) -> None:
            events.append(("shutdown", self.tp.size))

    monkeypatch.setattr(main, "Engine", RecordingEngine)
    config = stage(FOLDER, "config").EngineConfig(model=str(model_dir))
    main.demo(config, max_tokens=2)
    assert events == [("start", 1), ("shutdown", 1), ("start", 3), ("shutdown", 3)]
    assert in_memory == [0, 0], "an engine was still in memory when the next one started"


# --- one rank in a process group: the parallel path on one device -----------------------------------------------


def counted(issued: Counter, name: str, collective):
    """``collective``, counting its calls in ``issued[name]``."""
    def count(*args, **kwargs):
        issued[name] += 1
        return collective(*args, **kwargs)

    return count


def test_one_rank_in_a_process_group_issues_every_collective_and_gives_the_tokens_of_none(tiny, monkeypatch):
    """--process-group (torchrun --nproc-per-node 1 on a GPU, with NCCL): one rank with a real process group
    issues every collective a split engine does (each layer's two all-reduces and the embedding's, the logits'
    gather, the step's broadcast), to itself, and answers exactly as an engine without a group."""
    prompts = [[(7 * i + 3) % 256 for i in range(40)], [(5 * i + 1) % 256 for i in range(17)]]
    params = sampler.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = make_engine(FOLDER, tiny["llama"], kv_cache_mb=4).generate_offline(prompts, params)
    issued: Counter = Counter()
    for name in ("all_reduce", "gather", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(torch.distributed, name, counted(issued, name, getattr(torch.distributed, name)))
    engine = make_engine(FOLDER, tiny["llama"], kv_cache_mb=4, process_group=True)
    try:
        assert engine.tp.size == 1 and engine.tp.group is not None and not engine.ranks.workers
        assert issued["barrier"] == 2, "the ranks agree when all have loaded their weights, then when all started"
        execute, steps = engine.runner.execute, []
        monkeypatch.setattr(engine.runner, "execute", lambda inputs: steps.append(1) or execute(inputs))
        before = issued.copy()
        assert engine.generate_offline(prompts, params) == expected
        per_step = {"all_reduce": 2 * engine.model.config.num_layers + 1, "gather": 1, "broadcast_object_list": 1}
        assert {name: issued[name] - before[name] for name in per_step} == {
            name: count * len(steps) for name, count in per_step.items()}
    finally:
        engine.shutdown()
    assert engine.tp.group is None and not torch.distributed.is_initialized()


def test_a_bfloat16_all_reduce_sums_in_float32(monkeypatch):
    """N bfloat16 partial sums added in bfloat16 round N - 1 more times than the unsplit matmul: on a GPU the split
    model's tokens would drift from one rank's. The all-reduce sums in float32 and rounds once; float32 in place."""
    ranks = distributed.start_ranks(1, torch.device("cpu"), 5.0, None, (), process_group=True)
    reduced, all_reduce = [], torch.distributed.all_reduce
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, **kw: reduced.append(x) or all_reduce(x, **kw))
    try:
        x = torch.randn(4, 8).to(torch.bfloat16)
        total = ranks.tp.all_reduce(x)
        assert reduced[-1].dtype == torch.float32 and total.dtype == torch.bfloat16
        assert torch.equal(total, x)  # one rank: the sum is its own part
        y = torch.randn(4, 8)
        assert ranks.tp.all_reduce(y) is y and reduced[-1] is y, "a float32 all-reduce needs no copy"
    finally:
        ranks.stop()


# --- a worker's loop: the steps rank 0 broadcasts ----------------------------------------------------------------

STEPS = [7, 11]  # the steps rank 0 broadcasts before Stop (numbers stand for StepInputs)
SERVE_TIMEOUT_S = 5.0  # how long a rank waits in a step's collective, and a worker may take to leave after Stop


class RecordingRunner:
    """A model runner in miniature: it records each step it runs, and enters one all-reduce of the step's number, as a
    forward pass enters its layers' (rank 0 enters the same one)."""

    def __init__(self, tp: distributed.TPGroup) -> None:
        self.tp, self.steps = tp, []

    def execute(self, step: int) -> tuple[None, None]:
        self.steps.append(step)
        self.tp.all_reduce(torch.tensor([float(step)]))
        return None, None  # a rank > 0 gets no logits


def recording_worker(rank: int, init_method: str, record: str) -> None:
    """Rank 1 of 2: join, ``serve`` with a RecordingRunner, and once it returns write down the steps it ran."""
    tp = distributed.join(rank, 2, torch.device("cpu"), SERVE_TIMEOUT_S, store=distributed.check_in(init_method))
    runner = RecordingRunner(tp)
    try:
        stage(FOLDER, "worker").serve(runner, tp)
    finally:
        tp.close()
    Path(record).write_text(json.dumps(runner.steps))


@pytest.mark.exercise("9.6")
def test_a_worker_runs_each_step_rank_0_broadcasts_in_order_and_leaves_on_stop(tmp_path):
    """Two gloo processes: this one is rank 0, broadcasts two steps (entering each one's all-reduce) and then Stop;
    rank 1 serves them. It must run exactly those steps, in order, in step with rank 0's collectives, and leave
    cleanly on Stop. Every wait has a deadline: a worker that misses Stop fails the test, it does not hang it."""
    record = tmp_path / "steps.json"
    ranks = distributed.start_ranks(2, torch.device("cpu"), SERVE_TIMEOUT_S, recording_worker, (str(record),))
    worker = ranks.workers[0]
    try:
        for step in STEPS:
            ranks.send(step)  # raises RanksOutOfStep if the worker has left
            try:
                total = ranks.tp.all_reduce(torch.tensor([float(step)]))
            except RuntimeError as exc:
                pytest.fail(f"rank 1 did not enter step {step}'s collective within {SERVE_TIMEOUT_S:g} s: {exc}")
            assert total.item() == 2 * step, f"rank 1 ran another step than {step}"
        ranks.send(distributed.Stop())
        worker.join(SERVE_TIMEOUT_S)
        assert not worker.is_alive(), f"the worker still runs {SERVE_TIMEOUT_S:g} s after Stop: its loop missed it"
        assert worker.exitcode == 0, f"the worker failed (exit code {worker.exitcode}): Stop ends the loop"
        assert json.loads(record.read_text()) == STEPS, "the worker must run each step rank 0 sent, once, in order"
    finally:
        ranks.stop(graceful=False)  # terminates a worker still running
    assert not torch.distributed.is_initialized()


# --- starting up: a worker that exits, a rank slow to load ---------------------------------------------------------


def exits_at_once(rank: int, init_method: str) -> None:
    """A worker that exits before it joins the others (a bad flag, no such GPU, out of memory)."""
    os._exit(3)


def assert_the_start_fails_at_once(start: Callable[[], object], monkeypatch, exit_code: int, timeout_s: float) -> None:
    """``start()`` (it starts ranks) raises within ``timeout_s``, naming the worker that exited with ``exit_code``;
    no process group is left, and every worker it spawned is gone. Run on a thread: without the check under test,
    rank 0 would wait for ever."""
    spawned, outcome = [], {}
    spawn_workers = distributed.spawn_workers
    monkeypatch.setattr(distributed, "spawn_workers", lambda *args: spawned.extend(spawn_workers(*args)) or spawned)

    def run() -> None:
        try:
            start()
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "rank 0 still waits for a worker that has exited"
    assert f"exited (exit code {exit_code})" in str(outcome["error"])
    assert not torch.distributed.is_initialized()
    assert_all_stopped([worker.pid for worker in spawned])


@pytest.mark.e2e  # a whole model or a process: left out of `make test-fast`
def test_a_worker_that_exits_before_joining_fails_the_start_at_once(monkeypatch):
    """Rank 0 waits for its workers to check in while watching them: one that exits fails the start within seconds,
    naming its rank and exit code, instead of leaving rank 0 in the rendezvous (which has no timeout) for good."""
    assert_the_start_fails_at_once(lambda: distributed.start_ranks(3, torch.device("cpu"), 5.0, exits_at_once, ()),
                                   monkeypatch, exit_code=3, timeout_s=60)


def dies_loading_worker(rank: int, init_method: str, *args) -> None:
    """``run_worker``, in a worker that joins the group and then dies loading its weights (out of memory, say)."""
    worker = stage(FOLDER, "worker")
    worker.LlamaForCausalLM = SimpleNamespace(from_pretrained=lambda *a, **k: os._exit(4))
    worker.run_worker(rank, init_method, *args)


def test_a_worker_that_dies_loading_its_weights_fails_the_start_and_leaves_no_process(tiny, monkeypatch):
    """After the rendezvous, rank 0 waits for the others' weights in the start-up group, which has no timeout: it
    watches its workers meanwhile, so one that dies there fails the start within seconds, and the group is gone."""
    monkeypatch.setattr(stage(FOLDER, "engine"), "run_worker", dies_loading_worker)
    assert_the_start_fails_at_once(
        lambda: make_engine(FOLDER, tiny["llama"], kv_cache_mb=4, tensor_parallel_size=2, speculative="off"),
        monkeypatch, exit_code=4, timeout_s=90)


SLOW_LOAD_S = 5.0  # a worker's weights load this much later than rank 0's: longer than the test's --dist-timeout


def slow_to_load_worker(rank: int, init_method: str, *args) -> None:
    """``run_worker``, in a worker whose weights take SLOW_LOAD_S longer to load, and whose start-up begins with a
    forward pass as on CUDA (``forward_first``)."""
    worker = stage(FOLDER, "worker")
    load = worker.LlamaForCausalLM.from_pretrained
    worker.LlamaForCausalLM = SimpleNamespace(from_pretrained=lambda *a, **k: time.sleep(SLOW_LOAD_S) or load(*a, **k))
    worker.start_runner = forward_first(worker.start_runner)
    worker.run_worker(rank, init_method, *args)


def forward_first(start_runner):
    """``start_runner`` as it begins on CUDA: a forward pass (sizing the pool after the activations' peak), its
    all-reduces in the forward pass's group and its short timeout, before anything else."""
    kv_cache = stage(FOLDER, "kv_cache")

    def start(config, model, device, *args):
        dtype = model.model.embed_tokens.weight.dtype
        shape = model.config.cache_shape(config.block_size, dtype, model.tp.size)
        model_runner.run_dummy_step(model, kv_cache.KVCache.allocate(shape, shape.bytes_per_block, device), device, 4)
        return start_runner(config, model, device, *args)

    return start


def test_a_rank_slow_to_load_its_weights_still_starts(tiny, monkeypatch):
    """The ranks agree that all have loaded their weights (in the start-up group, no short timeout) before any
    forward pass: a worker that loads SLOW_LOAD_S later does not make rank 0's first all-reduce time out after
    --dist-timeout (2 s here), even when start-up begins with a forward pass, as it does on CUDA."""
    engine_module = stage(FOLDER, "engine")
    monkeypatch.setattr(engine_module, "run_worker", slow_to_load_worker)
    monkeypatch.setattr(engine_module, "start_runner", forward_first(engine_module.start_runner))
    engine = make_engine(FOLDER, tiny["llama"], kv_cache_mb=4, tensor_parallel_size=2, dist_timeout=2.0,
                         speculative="off")
    workers = [worker.pid for worker in engine.ranks.workers]
    try:
        params = sampler.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(engine.generate_offline([[1, 2, 3]], params)[0]) == 4
    finally:
        engine.shutdown()
    assert_all_stopped(workers)


# --- the server on two ranks, and the ways ranks go away -------------------------------------------------------


def test_the_server_on_two_ranks_answers_streams_and_frees_aborted_blocks(tiny, monkeypatch):
    engine = make_engine(FOLDER, tiny["llama"], kv_cache_mb=4, tensor_parallel_size=2)
    prompt = [(5 * i + 1) % 256 for i in range(30)]
    expected = make_engine(FOLDER, tiny["llama"], kv_cache_mb=4).generate_offline(
        [prompt], sampler.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    try:
        with serve_stage(FOLDER, engine) as server:
            client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
            text = engine.tokenizer.decode(expected)
            answer = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert answer.choices[0].text == text
            stream = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=8,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            assert "".join(chunk.choices[0].text for chunk in stream) == text
            # A client that leaves mid-answer: its blocks return (rank 0 keeps the one block table of every rank).
            # A step of this tiny model takes about a millisecond: slowed down, the answer is still running when
            # the client leaves, whatever else the machine is doing.
            execute = engine.runner.execute
            monkeypatch.setattr(engine.runner, "execute", lambda inputs: time.sleep(0.02) or execute(inputs))
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={
                    "prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True}) as response:
                next(response.iter_lines())
                deadline = time.monotonic() + 10  # on a loaded machine the step that admits it may come a bit later
                while not engine.block_manager.num_used and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert engine.block_manager.num_used > 0
            deadline = time.monotonic() + 10
            while engine.block_manager.num_used and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.block_manager.num_used == 0
            # The ranks are still in step: the same answer again.
            again = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=8,
                                              temperature=0, extra_body={"ignore_eos": True})
            assert again.choices[0].text == text
    finally:
        engine.shutdown()


def fails_with_503_when(engine, fault) -> None:
    """Serve ``engine`` (two ranks), start a long request, apply ``fault``: the request ends with a 503, /health
    turns 503, later requests get 503 at once, and the worker process is gone."""
    worker = engine.ranks.workers[0]
    with serve_stage(FOLDER, engine) as server:
        result: dict = {}

        def long_request() -> None:
            result["response"] = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True})

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 20
        while engine.stats().running == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        fault(worker.pid)
        thread.join(60)
        assert result["response"].status_code == 503, result["response"].text
        assert result["response"].json()["error"]["code"] == "engine_stopped"
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        later = httpx.post(f"{server.url}/v1/completions", timeout=10, json={"prompt": "hi", "max_tokens": 2})
        assert later.status_code == 503
    assert_all_stopped([worker.pid])


def test_a_worker_killed_mid_request_stops_the_engine_with_503s(tiny):
    engine = make_engine(FOLDER, tiny["llama"], kv_cache_mb=4, tensor_parallel_size=2)
    fails_with_503_when(engine, lambda pid: os.kill(pid, signal.SIGKILL))


def test_a_collective_that_times_out_stops_the_engine_with_503s(tiny):
    """A worker that hangs (stopped, not dead): rank 0's next collective waits --dist-timeout seconds, then fails."""
    engine = make_engine(FOLDER, tiny["llama"], kv_cache_mb=4, tensor_parallel_size=2, dist_timeout=3.0)
    fails_with_503_when(engine, lambda pid: os.kill(pid, signal.SIGSTOP))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_stopping_the_server_process_stops_every_rank(tiny, sig):
    """``python -m 09_tensor_parallel --tensor-parallel-size 2``: SIGTERM (a supervisor), SIGINT (Ctrl-C) or
    SIGKILL (nothing runs in rank 0 any more) on the server process, and no process of it is left."""
    port = free_port()
    command = [sys.executable, "-m", FOLDER, "--model", str(tiny["llama"]), "--device", "cpu",
               "--kv-cache-mb", "4", "--tensor-parallel-size", "2", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120)
        ranks = [server.pid] + [child.pid for child in psutil.Process(server.pid).children(recursive=True)]
        assert len(ranks) >= 2, "the server should have started a worker"
        server.send_signal(sig)
        server.wait(30)
        assert_all_stopped(ranks)
    finally:
        if server.poll() is None:
            server.kill()


@dataclass
class ExitedWorker:
    """A worker process as rank 0 sees it, once killed."""

    exitcode: int = -9
    pid: int = 0

    def is_alive(self) -> bool:
        return False


class NeverDone:
    """A CUDA event whose work never completes: a collective waiting for a peer that is gone."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return False


def test_rank_0_stops_waiting_for_a_step_when_a_worker_has_exited_or_time_is_up():
    """On a GPU rank 0 waits for each step's work by polling an event (``wait_until``), never blocked: a collective
    replayed in a CUDA graph has no timeout, and would hold a blocking wait for ever. A dead worker ends the wait at
    once, a stuck one at the deadline."""
    started = time.monotonic()
    dead = distributed.Ranks(workers=[ExitedWorker()])
    with pytest.raises(distributed.RanksOutOfStep, match=r"rank 1 exited \(exit code -9\)"):
        distributed.wait_until(NeverDone().query, 60.0, dead.exited, "the step's GPU work", 1e-4)
    with pytest.raises(distributed.RanksOutOfStep, match="waited 0.2 s for the step's GPU work"):
        distributed.wait_until(NeverDone().query, 0.2, distributed.Ranks().exited, "the step's GPU work", 1e-4)
    assert time.monotonic() - started < 10
    answers = iter([False, False, True])  # done on the third look, every worker running
    distributed.wait_until(lambda: next(answers), 60.0, distributed.Ranks().exited, "the step's GPU work", 1e-4)


def test_a_step_that_never_finishes_on_the_gpu_stops_the_engine(tiny, monkeypatch):
    """The engine's side of it, on a CPU pretending: a one-rank group, the step's event never done. The step raises
    EngineStopped (the server's 503) after --dist-timeout instead of hanging."""
    engine_module = stage(FOLDER, "engine")
    engine = make_engine(FOLDER, tiny["llama"], kv_cache_mb=4, process_group=True, dist_timeout=0.5)
    try:
        engine.add_request("r", [1, 2, 3], sampler.SamplingParams(max_tokens=4, temperature=0.0))
        engine.executor.waits_for_ranks = True  # as on a GPU: the step's tensors stay on the CPU; only the wait is its
        monkeypatch.setattr(stage(FOLDER, "executor").torch.cuda, "Event", NeverDone)
        with pytest.raises(engine_module.EngineStopped, match="waited 0.5 s for the step's GPU work"):
            engine.step()
    finally:
        engine.shutdown()


def test_under_nccl_the_watchdog_leaves_failures_to_the_engine(monkeypatch):
    """PyTorch's NCCL watchdog tears the whole process down when a collective times out (its default handling): the
    server would die instead of answering 503. ``join`` turns that off, and the watchdog's monitor too, before it
    creates the NCCL groups. (On a CPU: the GPU and the process group pretended, the environment checked when the
    group would be created.)"""
    seen = {}

    class Created(Exception):
        pass

    def init_process_group(backend, **kwargs):
        seen.update(backend=backend, handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
                    monitoring=os.environ.get("TORCH_NCCL_ENABLE_MONITORING"))
        raise Created

    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING"):
        monkeypatch.setenv(name, "")  # restored (unset, here) after the test, whatever join sets
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises(Created):
        distributed.join(0, 1, torch.device("cuda"), 5.0)
    assert seen == {"backend": "nccl", "handling": "0", "monitoring": "0"}
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # someone debugging chose otherwise: theirs
    with pytest.raises(Created):
        distributed.join(0, 1, torch.device("cuda"), 5.0)
    assert seen["handling"] == "1"
