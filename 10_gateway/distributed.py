"""The ranks of a tensor-parallel engine: how they start, talk and stop.

A tensor-parallel engine runs one model on N processes, the *ranks*. Rank 0 is the engine the server
talks to: it schedules, samples and answers. Ranks 1 .. N-1 are *workers*, model runners only: each
holds its slice of every layer (``parallel.py``) and runs whatever step rank 0 sends it. The ranks form
one process group and talk through collectives, the same calls on CPUs and GPUs; only the backend differs:

    gloo   CPU tensors, over TCP (here: loopback between processes on one machine)
    nccl   GPU tensors, over NVLink or InfiniBand, launched by the GPUs themselves (and capturable in a graph)

Two ways to start them:

    python -m 09_tensor_parallel --tensor-parallel-size 2     rank 0 spawns ranks 1 .. N-1 itself
    torchrun --nproc-per-node 2 -m 09_tensor_parallel ...     torchrun starts every rank (on one machine or
                                                              several); each finds the others through env://

Every rank starts up the same way (``worker.py``). Then each step rank 0 *broadcasts* the step's plain
numbers (a ``StepInput``) and every rank runs the same forward pass on its own slices; the collectives inside
the model keep them in step; ``Stop`` is the last message. These control messages go through a second,
gloo-only group, pickled: a step is a few kilobytes of Python lists, and on a GPU machine it must not wait
behind NCCL kernels.

Timeouts say when waiting means a rank is gone or stuck. Each process sets its own: rank 0 and the forward
pass's collectives wait ``--dist-timeout`` seconds at most (gloo's broadcast waits until the receiver
takes the message, so a stuck worker would hold rank 0 forever), while a worker waits for rank 0's next
step as long as the server stays idle. Agreeing at start-up (``min``) waits as long as the slowest rank
takes to load its weights, in a third group.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.net import free_port

log = logging.getLogger("llm-course")

IDLE_TIMEOUT = timedelta(days=365)  # how long a worker may wait for rank 0's next step: as long as it likes


class RanksOutOfStep(RuntimeError):
    """A tensor-parallel forward pass failed on this rank: the ranks can no longer be assumed to be in the
    same collective, so the engine cannot go on."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the ranks, and the collectives the model and the engine use.

    With ``size`` 1 (the default, and every stage before this one) there is no process group and every
    collective returns its input: a single-device engine runs exactly the code of a parallel one."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the forward pass's collectives: gloo or NCCL, timeout --dist-timeout (None: no processes)
    control: Any = None  # rank 0's step messages: gloo (a worker waits there when idle)
    startup: Any = None  # start-up agreements: gloo, waiting as long as the slowest rank takes to load its weights
    local_rank: int = 0  # the rank on its own machine: which GPU it drives
    threads_before: int = 0  # on a CPU: the process's PyTorch threads before it joined, given back by close()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place: every rank ends with the same total."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` side by side along the last dimension, on rank 0 (the others get None)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, message: Any) -> Any:
        """Rank 0's ``message`` on every rank (the others' argument is ignored): a pickled Python object."""
        if self.size == 1:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest ``value`` of any rank: what every rank can afford (the KV cache's number of blocks)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.startup)
        return int(tensor.item())

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before:
            torch.set_num_threads(self.threads_before)


SINGLE = TPGroup()  # one rank: no processes, no communication


def device_of(device: torch.device, tp: TPGroup) -> torch.device:
    """Each rank its own GPU: ``cuda:local_rank``. On a CPU the ranks share the machine's cores instead."""
    return torch.device("cuda", tp.local_rank) if device.type == "cuda" else device


def join(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float,
         local_rank: int | None = None) -> TPGroup:
    """Join the process group as ``rank`` of ``size``: every rank calls this, and it returns when all have."""
    local_rank = rank if local_rank is None else local_rank
    threads_before = torch.get_num_threads()
    if device.type == "cuda":  # before anything touches the GPU: NCCL binds each rank to the current device
        torch.cuda.set_device(local_rank)
    else:  # the ranks share the cores: each takes its part, or N processes would each run as many threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Meeting up waits for every process to start (importing PyTorch takes seconds): no short timeout here.
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if rank == 0 else IDLE_TIMEOUT)
    startup = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, size, group, control, startup, local_rank, threads_before if device.type == "cpu" else 0)


@dataclass(frozen=True)
class Stop:
    """Rank 0's last message: the workers leave their loop (and their process)."""


@dataclass
class Ranks:
    """Rank 0's side of the group: its place in it, and the worker processes it started (none under torchrun,
    which starts every rank itself and watches them). One rank: no group, no workers, nothing to send."""

    tp: TPGroup = SINGLE
    workers: list[BaseProcess] = field(default_factory=list)  # ranks 1 .. N-1, when this process started them

    def send(self, message: Any) -> None:
        """Every worker receives ``message``: a step to run (``StepInput``), or ``Stop``."""
        if self.tp.size == 1:
            return
        try:
            self.tp.broadcast(message)
        except Exception as exc:  # a worker is gone or stuck: the ranks can no longer be in step
            raise RanksOutOfStep(f"rank 0: {type(exc).__name__}: {exc}") from exc

    def exited(self) -> str | None:
        """Which worker this process started has exited, and how; None while every one runs."""
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                return f"tensor-parallel rank {rank} exited (exit code {worker.exitcode})"
        return None

    def stop(self, graceful: bool = True) -> None:
        """Stop every worker and leave none behind: ``graceful``, tell them and give them time to leave; after a
        failure (the ranks out of step, one gone or stuck), terminate them at once. Idempotent."""
        if self.tp.size == 1:
            return
        if graceful and self.exited() is None:
            try:
                self.send(Stop())
            except RanksOutOfStep as exc:  # a rank is gone: there is nobody left to tell
                log.warning("could not tell the other ranks to stop: %s", exc)
        stop_workers(self.workers, timeout_s=10.0 if graceful else 0.0)
        self.tp.close()
        self.tp, self.workers = SINGLE, []


def start_ranks(size: int, device: torch.device, timeout_s: float, worker: Callable[..., None],
                args: tuple[Any, ...]) -> Ranks:
    """Rank 0: start ranks 1 .. size-1 running ``worker(rank, init_method, *args)`` and join them in one process
    group (under torchrun they were started beside this process, and env:// says where to meet)."""
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes: pass --tensor-parallel-size "
                             f"{os.environ['WORLD_SIZE']}")
        return Ranks(join(int(os.environ["RANK"]), size, "env://", device, timeout_s,
                          local_rank=int(os.environ.get("LOCAL_RANK", 0))))
    if size == 1:
        return Ranks()
    init_method, workers = spawn_workers(size, worker, args)
    return Ranks(join(0, size, init_method, device, timeout_s), workers)


def under_torchrun() -> bool:
    """torchrun (or any launcher that sets the env:// variables) started this process as one of the ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def spawn_workers(size: int, target: Any, args: tuple[Any, ...]) -> tuple[str, list[BaseProcess]]:
    """Start ranks 1 .. size-1 as fresh processes running ``target(rank, init_method, *args)``.

    ``spawn``, not ``fork``: a forked child would inherit this process's threads (the server's, PyTorch's)
    in whatever state they were, and CUDA cannot be used in a forked child at all."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.get_context("spawn")
    workers = [context.Process(target=target, args=(rank, init_method, *args), name=f"tp-rank-{rank}", daemon=True)
               for rank in range(1, size)]
    for worker in workers:
        worker.start()
    return init_method, workers


def stop_workers(workers: list[BaseProcess], timeout_s: float = 10.0) -> None:
    """Wait for the workers to leave; terminate, then kill, any that do not: no process is left behind."""
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(2)
        if worker.is_alive():
            worker.kill()
            worker.join()


def exit_with_parent() -> None:
    """In a worker: leave as soon as the process that started it is gone, whatever it was waiting for."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.error("rank 0 is gone: this worker exits")
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
