"""The model runner: ``prepare`` a scheduled batch as plain numbers, ``execute`` it eagerly or from static buffers.

The model takes one step's tokens laid end to end, ``input_ids: [T]`` and ``positions: [T]``, with
no padding. One step mixes both kinds of rows: every decoding sequence contributes its one new token,
and every sequence being prefilled its chunk, the ``num_scheduled_tokens`` tokens after the
``num_computed_tokens`` already in the cache (its cached prefix and its earlier chunks)::

    tokens   | d0 | d1 | d2 | p0 p0 p0 p0 p0 p0 | p1 p1 p1 |      3 decodes, 2 chunks: T = 12
    query_start_loc  0    1    2    3                   9          12
    seq_lens        41   17   90   16 + 6 = 22         0 + 3 = 3  (cached + new)

A step where every row is one token (a decode step, the most common kind) runs
from **static buffers**: tensors allocated once, at fixed addresses, sized for the largest batch.
The step's numbers are copied into their first rows and the rest is padding that writes nothing
(slot -1) and reads nothing (context length 0). The batch size is rounded up to a *bucket* (1, 2,
4, 8, then every 16), so that a few shapes serve every batch::

    5 decoding sequences -> bucket 8:
    input_ids     [a  b  c  d  e | 0  0  0 ]
    slot_mapping  [s0 s1 s2 s3 s4| -1 -1 -1]    padding writes no KV
    seq_lens      [41 17 90 5  33| 0  0  0 ]    and attends to nothing (zeros)
    block_tables  [5 rows of blocks, then 3 rows of 0] x W columns, W = ceil(max_model_len / block_size) always
    logits_indices [rows whose logits are needed, then 0]

Everything a step needs goes in before it runs, through a CPU twin of the buffers (one buffer, pinned on CUDA,
sent in one copy that does not block the CPU): nothing is read back from the GPU, and nothing made for the step is sent
there, between the step's start and its logits. A block table comes as its sequence's own list of blocks,
as long as it is; the rows are padded with block 0 up to the width in one tensor operation (a mask of
where each row's blocks go), not row by row in Python (at 64 rows of 512 columns that loop takes 2.4 ms a
step, most of what a replayed step takes on a GPU).

On CUDA each bucket's forward pass is captured once into a **CUDA graph** (``capture``): the GPU
records every kernel launch with its arguments, and a step then replays the whole pass with one
launch from the CPU instead of some 300 (``fused.py`` took the pass down from some 850 kernels: a graph
removes what launching costs the CPU, not what each kernel costs the GPU). Replay reads whatever the
static buffers hold, which is why they never move and why their shapes (the table width too) never
change. On a CPU nothing is captured: the same buffers, buckets and padding run eagerly, so every CPU
test exercises them.

Mixed and prefill steps, and steps that score prompts (echo), run eagerly, with tensors built for the
step (``run_eager``): their shapes change every step.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_left
from dataclasses import dataclass
from itertools import chain, pairwise

import torch

from common.device import keep_freed_memory

from .attention import AttentionMetadata, use_triton
from .block_manager import token_slots
from .config import EngineConfig
from .kv_cache import KVCache, budget_bytes
from .model import LlamaForCausalLM
from .scheduler import Batch

log = logging.getLogger("llm-course")


@dataclass
class StepInput:
    """One step as plain numbers: everything ``execute`` needs, nothing of the engine's objects."""

    input_ids: list[int]  # [T]: every sequence's new tokens, end to end
    positions: list[int]  # [T]: each token's position in its own sequence
    slot_mapping: list[int]  # [T]: the cache slot each token's K/V goes to (-1: nowhere)
    query_start_loc: list[int]  # [B + 1]: where each sequence's new tokens start in T
    seq_lens: list[int]  # [B]: cached + new tokens of each sequence after this step
    block_tables: list[list[int]]  # [B][its blocks]: each sequence's own table, as long as it is (not padded)
    logits_indices: list[int]  # [S]: the last row of each sequence that samples (not a mid-prompt chunk)
    prompt_logits_indices: list[int]  # the rows that score a prompt's next token, for the sequences that asked (echo)
    num_prompt_logits: list[int]  # [B]: how many of those rows belong to each sequence (0 for most)



def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets a decode step is padded to: 1, 2, 4, 8, then every 16 below ``max_num_seqs``, and
    ``max_num_seqs`` itself (so that every batch size the scheduler can make has a bucket)."""
    ### BEGIN SOLUTION 7.1
    sizes = {size for size in (1, 2, 4, 8) if size < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 16))
    return sorted(sizes | {max_num_seqs})
    ### END SOLUTION


def pad_block_tables(tables: list[list[int]], out: torch.Tensor) -> torch.Tensor:
    """The ragged ``tables`` written into ``out`` [R, W] (R >= len(tables)), returned: row i holds table i's blocks
    then block 0, the rows past the tables block 0 only. One flat tensor of every block, scattered in row-major
    order by a mask of where each row's blocks go: no row is padded in Python."""
    lens = torch.zeros(out.shape[0], dtype=torch.int64)  # [R]
    lens[: len(tables)] = torch.tensor([len(table) for table in tables], dtype=torch.int64)
    blocks = torch.tensor(list(chain.from_iterable(tables)), dtype=out.dtype)  # [sum of lens]
    out.zero_()
    out.masked_scatter_(torch.arange(out.shape[1]) < lens[:, None], blocks)  # mask [R, W]: True on a row's blocks
    return out


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` rows; None when none does (the step runs eagerly)."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def input_layout(rows: int, width: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Every input of a step from the static buffers, as it lies in their one buffer: name, dtype, shape. The int64
    inputs first (each an even number of int32 words, so every int64 view starts 8-byte aligned), the block
    tables last, so that a bucket's copy ends right after its own rows of the table."""
    return [("input_ids", torch.int64, (rows,)), ("positions", torch.int64, (rows,)),
            ("slot_mapping", torch.int64, (rows,)), ("logits_indices", torch.int64, (rows,)),
            ("query_start_loc", torch.int32, (rows + 1,)), ("query_lens", torch.int32, (rows,)),
            ("seq_lens", torch.int32, (rows,)), ("block_tables", torch.int32, (rows, width))]


def carve(flat: torch.Tensor, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Views of the int32 buffer ``flat``, one per input of ``layout``, laid end to end: no copies, no new memory."""
    views, offset = {}, 0
    for name, dtype, shape in layout:
        words = math.prod(shape) * dtype.itemsize // flat.element_size()
        views[name] = flat[offset:offset + words].view(dtype).view(shape)
        offset += words
    return views


@dataclass
class StaticBuffers:
    """A decode step's inputs and output at fixed addresses, sized for the largest bucket.

    A captured graph replays its kernels on exactly these tensors, so a step never allocates new ones:
    it copies its numbers in (``load``) and reads the output rows it needs. Every input is a view of one int32
    buffer (``inputs``, ``input_layout``), and has a twin in one CPU buffer (``staged``, pinned on CUDA; its views:
    ``staging``): a step writes its numbers into the twins, and one copy, without blocking the CPU, sends them all."""

    input_ids: torch.Tensor  # [max_bs] int64, padding 0 (any valid token: its row is thrown away)
    positions: torch.Tensor  # [max_bs] int64, padding 0
    slot_mapping: torch.Tensor  # [max_bs] int64, padding -1: write no K/V
    seq_lens: torch.Tensor  # [max_bs] int32, padding 0: attend to nothing, output zeros
    block_tables: torch.Tensor  # [max_bs, W] int32, padding 0; W never changes (a graph bakes in the stride)
    logits_indices: torch.Tensor  # [max_bs] int64: the rows whose logits the step needs, then 0
    query_start_loc: torch.Tensor  # [max_bs + 1] int32: 0, 1, 2, ... (one token a row, always)
    query_lens: torch.Tensor  # [max_bs] int32: all ones
    hidden: torch.Tensor  # [max_bs, hidden_size]: the forward pass's output
    inputs: torch.Tensor  # every input above but ``hidden``, end to end: the one buffer they are views of
    staged: torch.Tensor  # [same words] int32: the inputs' CPU twin (pinned on CUDA), what one copy sends
    staging: dict[str, torch.Tensor]  # each input's view of ``staged``, by name
    copied: torch.cuda.Event | None = None  # on CUDA: set when the last step's copy out of staging is done

    @classmethod
    def allocate(cls, max_bs: int, width: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> StaticBuffers:
        layout = input_layout(max_bs, width)
        words = sum(math.prod(shape) * kind.itemsize // 4 for _, kind, shape in layout)  # int32 words
        staged = torch.zeros(words, dtype=torch.int32, pin_memory=device.type == "cuda")
        staging = carve(staged, layout)
        staging["slot_mapping"].fill_(-1)  # padding: write no K/V
        staging["query_start_loc"].copy_(torch.arange(max_bs + 1))  # one token a row
        staging["query_lens"].fill_(1)
        inputs = torch.empty(words, dtype=torch.int32, device=device)
        inputs.copy_(staged)
        return cls(**carve(inputs, layout), hidden=torch.zeros(max_bs, hidden_size, dtype=dtype, device=device),
                   inputs=inputs, staged=staged, staging=staging)

    @property
    def width(self) -> int:
        return self.block_tables.shape[1]

    def load(self, step: StepInput, size: int) -> None:
        """Rows [0, n) get the step's n decode rows, rows [n, size) padding; nothing of an earlier step stays.
        The block tables and the logits' rows too: every number the step needs is on its way before it runs."""
        n = len(step.seq_lens)
        assert n <= size <= self.input_ids.shape[0], f"{n} rows do not fit a bucket of {size}"
        if self.copied is not None:  # the GPU may still be reading the last step's numbers out of staging
            self.copied.synchronize()
        pad = size - n
        ### BEGIN SOLUTION 7.3
        if any(len(table) > self.width for table in step.block_tables):
            raise ValueError(f"a block table is wider than the static buffers' {self.width} blocks")
        values = {
            "input_ids": step.input_ids + [0] * pad,
            "positions": step.positions + [0] * pad,
            "slot_mapping": step.slot_mapping + [-1] * pad,
            "seq_lens": step.seq_lens + [0] * pad,
        }
        ### END SOLUTION
        values["logits_indices"] = step.logits_indices + [0] * (size - len(step.logits_indices))
        for name, rows in values.items():
            self.staging[name][:size].copy_(torch.tensor(rows, dtype=self.staging[name].dtype))
        pad_block_tables(step.block_tables, self.staging["block_tables"][:size])  # each row padded to the width W
        self.send(size)

    def send(self, size: int) -> None:
        """One copy of the staged numbers to the inputs: every input, the block tables up to row ``size`` (the rest
        of the table is not the bucket's). Out of pinned memory it does not block the CPU; on CUDA an event marks
        when it is done, so that the next ``load`` does not overwrite numbers still being read."""
        end = self.block_tables.storage_offset() + size * self.width  # in words: the table comes last
        self.inputs[:end].copy_(self.staged[:end], non_blocking=True)  # pinned -> GPU: the CPU goes on
        if self.inputs.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a bucket of ``size`` rows: views of the buffers, never copies."""
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 query_lens=self.query_lens[:size], seq_lens=self.seq_lens[:size],
                                 block_tables=self.block_tables[:size], max_query_len=1,
                                 logits_indices=self.logits_indices[:size])


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device, max_num_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)  # the decode buckets, smallest first
        width = -(-max_model_len // kv_cache.shape.block_size)  # blocks of the longest possible sequence
        dtype = model.model.embed_tokens.weight.dtype
        self.buffers = StaticBuffers.allocate(self.sizes[-1], width, model.config.hidden_size, dtype, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> its captured decode step (CUDA only)
        self.capture_seconds: float | None = None  # how long capturing the graphs took; None: not captured
        self.graph_memory_bytes = 0  # what the captured graphs hold on the GPU

    def prepare(self, batch: Batch) -> StepInput:
        """Each sequence's ``num_scheduled_tokens`` tokens after its ``num_computed_tokens``, laid end to end."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        prompt_logits_indices: list[int] = []
        num_prompt_logits: list[int] = []
        for seq in batch.seqs:
            ### BEGIN SOLUTION 6.2
            start = seq.num_computed_tokens
            end = start + seq.num_scheduled_tokens  # a decode: end - start == 1; a chunk: part of the prompt
            input_ids.extend(seq.tokens(start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(token_slots(seq.block_table, self.block_size, start, end))
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)  # what its queries see: everything cached, and this step's tokens
            if seq.samples_next_token:
                logits_indices.append(query_start_loc[-1] - 1)
            ### END SOLUTION
            # Prompt logprobs (echo): the row at position p predicts prompt token p + 1, for p < len(prompt) - 1.
            scored = max(0, min(end, len(seq.prompt_ids) - 1) - start) if seq.needs_prompt_logprobs else 0
            prompt_logits_indices.extend(range(query_start_loc[-2], query_start_loc[-2] + scored))
            num_prompt_logits.append(scored)
        block_tables = [seq.block_table.copy() for seq in batch.seqs]  # ragged: padded where they become a tensor
        return StepInput(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_indices,
                         prompt_logits_indices=prompt_logits_indices, num_prompt_logits=num_prompt_logits)

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return self._to_device(torch.tensor(values, dtype=dtype))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU tensor on the runner's device. On CUDA through pinned memory and without blocking the CPU (the
        pinned block is not reused before the copy is done: PyTorch's pinned allocator waits on the copy's event);
        on a CPU the same call, which copies nothing."""
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """The step's ragged tables as one [B, longest] tensor, padded with block 0."""
        width = max(len(table) for table in tables)
        return self._to_device(pad_block_tables(tables, torch.empty(len(tables), width, dtype=torch.int32)))

    def bucket(self, step: StepInput) -> int | None:
        """The bucket a step runs in from the static buffers, or None: it runs eagerly (a prompt chunk of
        more than one token, prompt scoring, or more rows than the largest bucket)."""
        one_token_each = len(step.input_ids) == len(step.seq_lens)  # T == B: every row is one token
        if not one_token_each or step.prompt_logits_indices:
            return None
        return bucket_for(len(step.seq_lens), self.sizes)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass for the whole step.

        Returns the logits of the last token of each sequence that samples, [S, V] (S may be 0: a step of
        mid-prompt chunks only), and the logits of the prompt rows that score prompts, [M, V] (None when no
        sequence asked). Only those rows go through the output projection, and separately, so that nobody's
        sampled token depends on them.
        """
        size = self.bucket(step)
        if size is not None:
            hidden = self.run_static(step, size)  # [B, hidden]: the real rows of the bucket
            rows = self.buffers.logits_indices[: len(step.logits_indices)]  # [S]: loaded with the step's inputs
            return self.model.compute_logits(hidden[rows]), None
        return self.run_eager(step)

    def run_static(self, step: StepInput, size: int) -> torch.Tensor:
        """A decode step from the static buffers, padded to ``size`` rows: replayed if that bucket was captured,
        else run eagerly. Returns the hidden states of the step's own rows, [B, hidden] (a view of the buffer)."""
        ### BEGIN SOLUTION 7.4
        self.buffers.load(step, size)
        if size in self.graphs:
            self.graphs[size].replay()  # every kernel of the forward pass, one launch, on the buffers
        else:
            self.forward_static(size)
        return self.buffers.hidden[: len(step.seq_lens)]
        ### END SOLUTION

    def forward_static(self, size: int) -> None:
        """The forward pass on the first ``size`` rows of the static buffers, its output written into them.
        Exactly what a graph captures: no new inputs, no host reads, no shape that depends on the data."""
        buffers = self.buffers
        hidden = self.model(buffers.input_ids[:size], buffers.positions[:size], self.kv_cache,
                            buffers.metadata(size))  # [size, hidden]
        buffers.hidden[:size].copy_(hidden)

    def run_eager(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Any step, with tensors built for it: the path of prompt chunks, mixed steps and prompt scoring."""
        query_lens = [end - start for start, end in pairwise(step.query_start_loc)]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(step.slot_mapping, torch.int64),
            query_start_loc=self._tensor(step.query_start_loc),
            query_lens=self._tensor(query_lens),
            seq_lens=self._tensor(step.seq_lens),
            block_tables=self._block_tables(step.block_tables),
            max_query_len=max(query_lens),
            logits_indices=self._tensor(step.logits_indices, torch.int64),
        )
        input_ids = self._tensor(step.input_ids, torch.int64)  # [T]
        positions = self._tensor(step.positions, torch.int64)  # [T]
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]
        logits = self.model.compute_logits(hidden[meta.logits_indices])  # [S, V] float32
        prompt_logits = None
        if step.prompt_logits_indices:
            prompt_logits = self.model.compute_logits(hidden[self._tensor(step.prompt_logits_indices, torch.int64)])
        return logits, prompt_logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's decode step into a CUDA graph; keep the seconds it took and the bytes of
        GPU memory it took (the graphs' shared pool: the activations of the largest bucket, mostly).

        Largest first, all into one memory pool: the largest graph's activations size the pool and every
        smaller one reuses them. Each bucket runs once eagerly before its capture, so that lazy work
        (Triton's compilation, cuBLAS's workspace) happens outside the graph. The buffers hold padding
        only (slot -1, context 0): capturing writes no K/V and reads none."""
        assert self.device.type == "cuda" and use_triton(self.device), "CUDA graphs need CUDA and the Triton kernels"
        # What this process's allocator reserves for the graphs' pool (the device's free memory would also move
        # with every other process on the GPU). Capturing empties the allocator's cache first, so empty it here
        # too: what it held before must not count against the graphs.
        torch.cuda.empty_cache()
        start, reserved_before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self.buffers.load(StepInput([], [], [], [0], [], [], [], [], []), self.sizes[-1])  # all padding
        pool = None
        for size in reversed(self.sizes):
            self.forward_static(size)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.forward_static(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - reserved_before


# --- building a runner --------------------------------------------------------------------------------


def start_runner(config: EngineConfig, model: LlamaForCausalLM, device: torch.device,
                 max_num_batched_tokens: int) -> ModelRunner:
    """The model runner with its KV-cache pool, warmed up, its graphs captured: what the engine builds once
    the weights are loaded.

    The pool comes after the weights, so that on CUDA it takes a share of what they left; and after one run
    of the largest step, whose activations it must leave room for."""
    max_model_len, dtype = model.config.max_position_embeddings, model.model.embed_tokens.weight.dtype
    shape = model.config.cache_shape(config.block_size, dtype)
    if device.type == "cuda":  # what the largest step's activations take, before the pool takes the rest
        run_dummy_step(model, KVCache.allocate(shape, shape.bytes_per_block, device), device,
                       min(max_num_batched_tokens, max_model_len))
    if device.type == "cpu":  # attention's gathers allocate tens of MB per layer and step: keep them
        keep_freed_memory()
    kv_cache = KVCache.allocate(shape, budget_bytes(device, config.kv_cache_mb, config.gpu_memory_utilization),
                                device)
    runner = ModelRunner(model, kv_cache, config.block_size, device, config.max_num_seqs, max_model_len)
    # Warm up: compile every kernel now (a decode step and an extend step), not in a user's request. On CUDA the
    # extend kernel is tuned apart for each size of query (``query_rows_bucket``): 2 rows take the bucket of 16, the
    # largest step above the last, and 100 and 1,000 rows the two between, so that no served step pays for a tuning.
    most = min(max_num_batched_tokens, max_model_len)
    between = [n for n in (100, 1000) if n <= most] if device.type == "cuda" else []
    for num_tokens in (1, 2, *between):
        run_dummy_step(model, kv_cache, device, num_tokens)
    if device.type == "cuda" and use_triton(device) and not config.enforce_eager:
        runner.capture()
        log.info("captured the decode step for batch sizes %s in %.1f s (%.0f MiB)", runner.sizes,
                 runner.capture_seconds, runner.graph_memory_bytes / 2**20)
    return runner


def run_dummy_step(model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, num_tokens: int) -> None:
    """One forward pass of ``num_tokens`` tokens of one sequence that writes nothing (slot -1) and reads
    block 0 for every position: to compile the kernels, and to measure the activations' peak."""
    inputs = StepInput(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                       slot_mapping=[-1] * num_tokens, query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
                       block_tables=[[0] * -(-num_tokens // kv_cache.shape.block_size)],
                       logits_indices=[num_tokens - 1], prompt_logits_indices=[], num_prompt_logits=[0])
    runner = ModelRunner(model, kv_cache, kv_cache.shape.block_size, device, 1, model.config.max_position_embeddings)
    runner.execute(inputs)
