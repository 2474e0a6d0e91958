"""A worker: a rank > 0 of a tensor-parallel engine, in a process of its own.

A worker is only a model runner: no scheduler, no tokenizer, no sampler. It checks in with rank 0, joins
the process group, loads its slice of the model, waits until every rank has loaded its own
(``tp.wait_for_all``), and starts up exactly as rank 0 does (``model_runner.start_runner``: the pool sized
and agreed on with ``tp.min``, the warm-up, the graphs; the forward passes in it hold all-reduces, so every
rank must run the same one). Then it runs each step rank 0 sends it until rank 0 says ``Stop``; rank 0
alone decides and samples.
"""

from __future__ import annotations

import os
import signal

from common.device import pick_device, pick_dtype
from common.weights import resolve_model

from .config import EngineConfig
from .distributed import Stop, TPGroup, check_in, device_of, exit_with_parent, join
from .model import LlamaForCausalLM
from .model_runner import ModelRunner, start_runner
from .quantize import pick_quantization


def memory_report(runner: ModelRunner) -> str:
    """What this rank holds: its slices of the weights, its part of the KV cache."""
    tp, cache = runner.tp, runner.kv_cache
    return (f"rank {tp.rank} of {tp.size}: weights {runner.model.num_weight_bytes / 2**20:.1f} MiB, "
            f"KV cache {cache.num_bytes / 2**20:.1f} MiB ({cache.num_blocks} blocks of "
            f"{cache.shape.num_kv_heads} KV heads)")


def run_worker(rank: int, init_method: str, config: EngineConfig, max_num_batched_tokens: int) -> None:
    """A rank > 0, in its own process: join the group, load this rank's slices, start up as every rank does,
    then run the steps rank 0 sends until it says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal: rank 0 decides
    exit_with_parent()  # rank 0 killed outright: leave too
    device = pick_device(config.device)
    tp = join(rank, config.tensor_parallel_size, device, config.dist_timeout, store=check_in(init_method),
              local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    try:
        device = device_of(device, tp)  # on CUDA each rank its own GPU
        model_dir = resolve_model(config.model)
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=pick_dtype(config.dtype, device), device=device,
                                                 tp=tp, quantization=pick_quantization(config.quantization, model_dir))
        tp.wait_for_all()  # every rank's weights loaded: from here on, the ranks' collectives wait for no loading
        runner = start_runner(config, model, device, max_num_batched_tokens)  # as rank 0 does
        print(memory_report(runner), flush=True)
        tp.wait_for_all()  # every rank started up: rank 0's first step finds this one waiting for it
        serve(runner, tp)
    finally:
        tp.close()


def serve(runner: ModelRunner, tp: TPGroup) -> None:
    """Run every step rank 0 broadcasts (this rank's part of it; rank 0 gathers the logits) until ``Stop``.

    Rank 0 sends each step (``Ranks.send``) before it runs the step itself; ``tp.broadcast`` is the other end of
    that call, and on a rank > 0 returns what rank 0 sent. Every step must be run, in the order sent: its forward
    pass holds collectives that rank 0 enters too. ``Stop`` is not a step: it ends the loop, and the worker leaves."""
    assert tp.rank > 0, "rank 0 schedules the steps; the other ranks serve them"
    ### BEGIN SOLUTION 9.6
    while not isinstance(message := tp.broadcast(None), Stop):  # blocks until rank 0 sends the next message
        runner.execute(message)
    ### END SOLUTION
