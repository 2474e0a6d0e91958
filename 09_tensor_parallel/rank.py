"""One rank of a tensor-parallel engine: its start-up, and what a worker rank does.

Every rank, rank 0 included, starts up the same way (``start_rank``): with its slice of the model loaded,
it measures what a step's activations take (on CUDA), sizes its KV cache, agrees with the others on the
number of blocks, warms its kernels up and captures its graphs. The forward passes among these steps hold
all-reduces, and ``tp.min`` is one more collective: since every rank runs this one function, their
collectives line up one for one, and nowhere else does start-up talk across ranks.

A *worker* (a rank > 0, ``run_worker``) is then only a model runner: no scheduler, no tokenizer, no
sampler. It runs each step rank 0 sends it until rank 0 says ``Stop``; rank 0 alone decides and samples.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

import torch

from common.device import keep_freed_memory, pick_device, pick_dtype
from common.weights import resolve_model

from .attention import use_triton
from .config import EngineConfig
from .distributed import Stop, TPGroup, device_of, exit_with_parent, join
from .kv_cache import KVCache, budget_bytes
from .model import LlamaForCausalLM
from .model_runner import ModelRunner, StepInput

log = logging.getLogger("llm-course")


@dataclass(frozen=True)
class StartedRank:
    runner: ModelRunner  # this rank's model, KV cache and static buffers
    capture_seconds: float | None  # how long capturing the graphs took; None: not captured
    graph_memory_bytes: int  # what the captured graphs hold on the GPU


def start_rank(config: EngineConfig, model: LlamaForCausalLM, max_num_batched_tokens: int,
               draft_bytes_per_block: int = 0) -> StartedRank:
    """This rank's KV cache and runner, warmed up and captured: the same steps, in the same order, on every rank.

    ``draft_bytes_per_block``: rank 0's draft model keeps its own K/V in a second pool of as many blocks, which
    the budget pays for too (with one rank only: a draft is refused beside a split model)."""
    weight, tp = model.model.embed_tokens.weight, model.tp
    device, dtype = weight.device, weight.dtype  # this rank's: cuda:local_rank on a GPU
    max_model_len = model.config.max_position_embeddings
    # The pool is allocated after the weights, so that on CUDA it takes a share of what they left.
    shape = model.config.cache_shape(config.block_size, dtype, tp.size)  # this rank's KV heads
    if device.type == "cuda":  # what the largest step's activations take, before the pool takes the rest
        run_dummy_step(config, model, min(max_num_batched_tokens, max_model_len),
                       KVCache.allocate(shape, shape.bytes_per_block, device), device)
    if device.type == "cpu":  # attention's gathers allocate tens of MB per layer and step: keep them
        keep_freed_memory()
    budget = budget_bytes(device, config.kv_cache_mb, config.gpu_memory_utilization)
    num_blocks = budget // (shape.bytes_per_block + draft_bytes_per_block)
    num_blocks = tp.min(num_blocks)  # one block table serves every rank: each must have every block
    kv_cache = KVCache.allocate(shape, num_blocks * shape.bytes_per_block, device)
    runner = ModelRunner(model, kv_cache, config.block_size, device, config.max_num_seqs, max_model_len)
    # Warm up: compile every kernel now (a decode step and an extend step), not in a user's request.
    for num_tokens in (1, 2):
        run_dummy_step(config, model, num_tokens, kv_cache, device)
    if device.type == "cuda" and use_triton(device) and not config.enforce_eager:
        capture_seconds, graph_memory_bytes = runner.capture()
        log.info("captured the decode step for batch sizes %s in %.1f s (%.0f MiB)", runner.sizes,
                 capture_seconds, graph_memory_bytes / 2**20)
        return StartedRank(runner, capture_seconds, graph_memory_bytes)
    return StartedRank(runner, None, 0)


def run_dummy_step(config: EngineConfig, model: LlamaForCausalLM, num_tokens: int, kv_cache: KVCache,
                   device: torch.device) -> None:
    """One forward pass of ``num_tokens`` tokens of one sequence that writes nothing (slot -1) and reads
    block 0 for every position: to compile the kernels, and to measure the activations' peak."""
    inputs = StepInput(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                       slot_mapping=[-1] * num_tokens, query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
                       block_tables=[[0] * -(-num_tokens // kv_cache.shape.block_size)],
                       logits_indices=[num_tokens - 1], prompt_logits_indices=[], num_prompt_logits=[0])
    ModelRunner(model, kv_cache, kv_cache.shape.block_size, device, config.max_num_seqs,
                model.config.max_position_embeddings).execute(inputs)


def memory_report(runner: ModelRunner) -> str:
    tp, cache = runner.tp, runner.kv_cache
    return (f"rank {tp.rank} of {tp.size}: weights {runner.model.num_weight_bytes / 2**20:.1f} MiB, "
            f"KV cache {cache.num_bytes / 2**20:.1f} MiB ({cache.num_blocks} blocks of "
            f"{cache.shape.num_kv_heads} KV heads)")


# --- ranks 1 .. N-1 ------------------------------------------------------------------------------------


def run_worker(rank: int, init_method: str, config: EngineConfig, max_num_batched_tokens: int) -> None:
    """A rank > 0, in its own process: join the group, load this rank's slices, start up as every rank does,
    then run the steps rank 0 sends until it says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal: rank 0 decides
    exit_with_parent()  # rank 0 killed outright: leave too
    device = pick_device(config.device)
    tp = join(rank, config.tensor_parallel_size, init_method, device, config.dist_timeout,
              local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    try:
        model = LlamaForCausalLM.from_pretrained(resolve_model(config.model), dtype=pick_dtype(config.dtype, device),
                                                 device=device_of(device, tp), tp=tp)
        runner = start_rank(config, model, max_num_batched_tokens).runner
        print(memory_report(runner), flush=True)
        serve(runner, tp)
    finally:
        tp.close()


def serve(runner: ModelRunner, tp: TPGroup) -> None:
    """Run every step rank 0 broadcasts (this rank's part of it; rank 0 gathers the logits) until ``Stop``."""
    assert tp.rank > 0, "rank 0 schedules the steps; the other ranks serve them"
    while not isinstance(message := tp.broadcast(None), Stop):
        runner.execute(message)
