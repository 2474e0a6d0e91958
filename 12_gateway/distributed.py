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

Starting up waits as long as the slowest rank needs, and no longer than a rank lives. A spawned worker
checks in with rank 0's ``TCPStore`` once it runs; rank 0 polls for every worker's arrival and fails at
once, naming the rank and its exit code, if one exits first. Then every rank loads its weights, and the
ranks agree that all have (``wait_for_all``), in a third, start-up group with no short timeout, before
any forward pass: the warm-up passes, the agreement on the pool (``min``) and the graph capture all
start with every rank ready.

Timeouts say when waiting means a rank is gone or stuck. Each process sets its own: rank 0 and the forward
pass's collectives wait ``--dist-timeout`` seconds at most (gloo's broadcast waits until the receiver
takes the message, so a stuck worker would hold rank 0 forever), while a worker waits for rank 0's next
step as long as the server stays idle. On a GPU the collectives run on the GPU's stream, and the host
only finds out by waiting for the step's work: rank 0 polls a CUDA event after each step (``wait_until``)
instead of blocking on it, and gives up past ``--dist-timeout`` or as soon as a worker has exited. A
failure stops the engine (the server answers 503) on both backends.

With one rank there is normally no process group: every collective returns its input. ``--process-group``
(or ``torchrun --nproc-per-node 1``) keeps one anyway, so that one rank issues every collective a split
engine does, through gloo on a CPU and NCCL on one GPU: the parallel path, tested on one device.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

log = logging.getLogger("llm-course")

IDLE_TIMEOUT = timedelta(days=365)  # how long a worker may wait for rank 0's next step: as long as it likes
ARRIVED = "workers-arrived"  # the key of rank 0's store that counts the spawned workers that have checked in
ARRIVAL_POLL_S = 0.05  # how often rank 0 looks for the workers' arrival (and checks they still run)
EXIT_GRACE_S = 2.0  # how long a failed start-up collective waits to learn which worker has exited
STEP_POLL_S = 1e-4  # how often rank 0 looks whether a step's GPU work is done: a decode step takes milliseconds


class RanksOutOfStep(RuntimeError):
    """A tensor-parallel forward pass failed on this rank: the ranks can no longer be assumed to be in the
    same collective, so the engine cannot go on."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the ranks, and the collectives the model and the engine use.

    Without a process group (``group`` None: one rank, the default, and every stage before this one) every
    collective returns its input: a single-device engine runs exactly the code of a parallel one. One rank
    with a group (``--process-group``, torchrun with one process) issues every collective, to nobody else."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the forward pass's collectives: gloo or NCCL, timeout --dist-timeout (None: no group)
    control: Any = None  # rank 0's step messages: gloo (a worker waits there when idle)
    startup: Any = None  # start-up agreements: gloo, waiting as long as the slowest rank takes to load its weights
    local_rank: int = 0  # the rank on its own machine: which GPU it drives
    threads_before: int = 0  # on a CPU: the process's PyTorch threads before it joined, given back by close()
    # Rank 0 of a spawned engine: which worker has exited (None while all run), checked while it waits at start-up
    watch: Callable[[], str | None] | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks: every rank ends with the same total, in ``x``'s dtype.

        The sum is taken in float32. Each rank's part is already rounded to the model's dtype; adding N
        bfloat16 parts in bfloat16 would round N - 1 more times (8 bits of precision: up to 0.4% each), and
        the split model's tokens would drift from the unsplit model's. In float32 the total rounds to
        bfloat16 once, as the unsplit matmul's does, for twice the bytes on the wire. A float32 ``x`` is
        summed in place, with no copy."""
        if self.group is None:
            return x
        total = x.float()  # x itself when it is float32: no copy
        dist.all_reduce(total, group=self.group)
        return total.to(x.dtype)  # a no-op for float32

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` side by side along the last dimension, on rank 0 (the others get None)."""
        if self.group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, message: Any) -> Any:
        """Rank 0's ``message`` on every rank (the others' argument is ignored): a pickled Python object."""
        if self.control is None:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest ``value`` of any rank: what every rank can afford (the KV cache's number of blocks)."""
        if self.startup is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        self._wait(dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.startup, async_op=True), "their pools")
        return int(tensor.item())

    def wait_for_all(self) -> None:
        """Return once every rank has called this, waiting as long as the slowest rank takes. Each rank calls it
        when its weights are loaded, before its first forward pass, so that the forward pass's collectives (and
        their short timeout) only ever wait for ranks that are ready; and once more when it has started up."""
        if self.startup is not None:
            self._wait(dist.barrier(group=self.startup, async_op=True), "the other ranks to start up")

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for a start-up collective as long as it takes, but on rank 0 of a spawned engine only while every
        worker runs: one that dies loading its weights (out of memory, say) fails the start at once."""
        if self.watch is None:
            work.wait()
            return
        wait_until(work.is_completed, math.inf, self.watch, what, ARRIVAL_POLL_S)
        try:
            work.wait()  # raises the collective's own error, if it failed
        except RuntimeError as exc:  # a rank that died closed its connections: name it, once its exit shows
            deadline = time.monotonic() + EXIT_GRACE_S
            while (why := self.watch()) is None and time.monotonic() < deadline:
                time.sleep(ARRIVAL_POLL_S)
            if why is None:
                raise
            raise RanksOutOfStep(f"{why} while rank 0 waited for {what}") from exc

    def close(self, failed: bool = False) -> None:
        """Leave the process group. After a failure on NCCL a collective may still be stuck on the GPU, waiting
        for a rank that is gone: abort the communicators (the stuck kernels return) rather than wait for it."""
        if self.group is not None and dist.is_initialized():
            if failed and dist.get_backend(self.group) == "nccl":
                dist.distributed_c10d._abort_process_group()  # PyTorch's own way out; needs the watchdog's handling off
            else:
                dist.destroy_process_group()
        if self.threads_before:
            torch.set_num_threads(self.threads_before)


SINGLE = TPGroup()  # one rank: no process group, no communication


def device_of(device: torch.device, tp: TPGroup) -> torch.device:
    """Each rank its own GPU: ``cuda:local_rank``. On a CPU the ranks share the machine's cores instead."""
    return torch.device("cuda", tp.local_rank) if device.type == "cuda" else device


def join(rank: int, size: int, device: torch.device, timeout_s: float, store: dist.Store | None = None,
         local_rank: int | None = None) -> TPGroup:
    """Join the process group as ``rank`` of ``size``: every rank calls this, and it returns when all have.
    ``store``: where the ranks meet (a spawned engine's, rank 0's ``TCPStore``); None: env:// (torchrun's)."""
    local_rank = rank if local_rank is None else local_rank
    threads_before = torch.get_num_threads()
    if device.type == "cuda":  # before anything touches the GPU: NCCL binds each rank to the current device
        torch.cuda.set_device(local_rank)
        keep_the_process_on_nccl_errors()
    else:  # the ranks share the cores: each takes its part, or N processes would each run as many threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Meeting up waits for every process to start (importing PyTorch takes seconds): no short timeout here.
    dist.init_process_group(backend, init_method="env://" if store is None else None, store=store, rank=rank,
                            world_size=size, timeout=IDLE_TIMEOUT)
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if rank == 0 else IDLE_TIMEOUT)
    startup = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, size, group, control, startup, local_rank, threads_before if device.type == "cpu" else 0)


def keep_the_process_on_nccl_errors() -> None:
    """Before any NCCL group exists (PyTorch reads these when it creates one): NCCL's failures are the engine's to
    handle, so that a rank gone or stuck becomes a 503, as under gloo, not a dead server.

    By default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) PyTorch's watchdog thread tears the whole process down when an
    eager collective times out or fails; 0 turns that handling off: rank 0's own deadline on each step
    (``wait_until``) finds the failure, and ``close`` aborts the communicators. The watchdog's own monitor
    (TORCH_NCCL_ENABLE_MONITORING) would also abort the process if the watchdog thread itself hung (in a NCCL or
    CUDA call) past TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: off too. A variable already set (someone debugging) is
    left as it is."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")


def check_in(init_method: str) -> dist.Store | None:
    """A spawned worker's first act: connect to rank 0's store (``tcp://host:port``) and count itself in, so that
    rank 0 knows it is alive and on its way to ``join``. Under torchrun (env://) there is nobody to tell: None."""
    if init_method == "env://":
        return None
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=IDLE_TIMEOUT)
    store.add(ARRIVED, 1)
    return store


def wait_until(done: Callable[[], bool], timeout_s: float, exited: Callable[[], str | None], what: str,
               poll_s: float) -> None:
    """Wait for ``done()`` in short sleeps, never blocked: raise RanksOutOfStep as soon as ``exited()`` names a
    rank that has exited, or once ``timeout_s`` seconds have passed. ``what``: what is awaited, for the message.

    Rank 0 waits this way for what a blocking call could wait on forever: the workers' arrival at start-up, and
    on a GPU each step's work (a collective inside a CUDA graph has no timeout of its own)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if (why := exited()) is not None:
            raise RanksOutOfStep(f"{why} while rank 0 waited for {what}")
        if time.monotonic() > deadline:
            raise RanksOutOfStep(f"rank 0 waited {timeout_s:g} s for {what}: a rank is stuck or gone")
        time.sleep(poll_s)


@dataclass(frozen=True)
class Stop:
    """Rank 0's last message: the workers leave their loop (and their process)."""


@dataclass
class Ranks:
    """Rank 0's side of the group: its place in it, and the worker processes it started (none under torchrun,
    which starts every rank itself and watches them). One rank without a group: no workers, nothing to send."""

    tp: TPGroup = SINGLE
    workers: list[BaseProcess] = field(default_factory=list)  # ranks 1 .. N-1, when this process started them

    def send(self, message: Any) -> None:
        """Every worker receives ``message``: a step to run (``StepInput``), or ``Stop``."""
        if self.tp.control is None:
            return
        try:
            self.tp.broadcast(message)
        except Exception as exc:  # a worker is gone or stuck: the ranks can no longer be in step
            raise RanksOutOfStep(f"rank 0: {type(exc).__name__}: {exc}") from exc

    def exited(self) -> str | None:
        """Which worker this process started has exited, and how; None while every one runs."""
        return exited(self.workers)

    def stop(self, graceful: bool = True) -> None:
        """Stop every worker and leave none behind: ``graceful``, tell them and give them time to leave; after a
        failure (the ranks out of step, one gone or stuck), terminate them at once. Idempotent."""
        if self.tp.group is None:
            return
        if graceful and self.exited() is None:
            try:
                self.send(Stop())
            except RanksOutOfStep as exc:  # a rank is gone: there is nobody left to tell
                log.warning("could not tell the other ranks to stop: %s", exc)
        stop_workers(self.workers, timeout_s=10.0 if graceful else 0.0)
        self.tp.close(failed=not graceful)
        self.tp, self.workers = SINGLE, []


def exited(workers: list[BaseProcess]) -> str | None:
    """Which of ``workers`` (ranks 1, 2, ...) has exited, and how; None while every one runs."""
    for rank, worker in enumerate(workers, start=1):
        if not worker.is_alive():
            return f"tensor-parallel rank {rank} exited (exit code {worker.exitcode})"
    return None


def start_ranks(size: int, device: torch.device, timeout_s: float, worker: Callable[..., None],
                args: tuple[Any, ...], process_group: bool = False) -> Ranks:
    """Rank 0: start ranks 1 .. size-1 running ``worker(rank, init_method, *args)`` and join them in one process
    group (under torchrun they were started beside this process, and env:// says where to meet). One rank has no
    group unless ``process_group`` asks for one (or torchrun started it).

    Rank 0 waits for the workers to check in (``check_in``) before it joins them, watching them meanwhile: a worker
    that exits before joining (a bad flag, no such GPU, out of memory) fails the start at once, and takes the other
    workers with it."""
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes: pass --tensor-parallel-size "
                             f"{os.environ['WORLD_SIZE']}")
        return Ranks(join(int(os.environ["RANK"]), size, device, timeout_s,
                          local_rank=int(os.environ.get("LOCAL_RANK", 0))))
    if size == 1 and not process_group:
        return Ranks()
    # Port 0: the store takes a free port itself, and the workers are told which.
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=IDLE_TIMEOUT, wait_for_workers=False)
    workers = spawn_workers(size, f"tcp://127.0.0.1:{store.port}", worker, args)
    try:
        wait_until(lambda: int(store.add(ARRIVED, 0)) == size - 1, math.inf, lambda: exited(workers),
                   "the workers to start", ARRIVAL_POLL_S)
        return Ranks(replace(join(0, size, device, timeout_s, store=store), watch=partial(exited, workers)), workers)
    except BaseException:
        stop_workers(workers, timeout_s=0.0)
        raise


def under_torchrun() -> bool:
    """torchrun (or any launcher that sets the env:// variables) started this process as one of the ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def spawn_workers(size: int, init_method: str, target: Any, args: tuple[Any, ...]) -> list[BaseProcess]:
    """Start ranks 1 .. size-1 as fresh processes running ``target(rank, init_method, *args)``.

    ``spawn``, not ``fork``: a forked child would inherit this process's threads (the server's, PyTorch's)
    in whatever state they were, and CUDA cannot be used in a forked child at all."""
    context = mp.get_context("spawn")
    workers = [context.Process(target=target, args=(rank, init_method, *args), name=f"tp-rank-{rank}", daemon=True)
               for rank in range(1, size)]
    for worker in workers:
        worker.start()
    return workers


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
