"""The model runner, one per rank: ``prepare`` a batch as plain numbers (rank 0), ``execute`` it (every rank).

The model takes one step's tokens laid end to end, ``input_ids: [T]`` and ``positions: [T]``, with
no padding. One step mixes both kinds of rows: every decoding sequence contributes its new token (and
its guesses, below), and every sequence being prefilled its chunk, the ``num_scheduled_tokens`` tokens
after the ``num_computed_tokens`` already in the cache (its cached prefix and its earlier chunks)::

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

Steps with a prompt chunk longer than 1 + K tokens (below), and steps that score prompts (echo), run
eagerly, with tensors built for the step (``run_eager``): their shapes change every step.

A decoding sequence may bring guesses (``draft_ids``), run right after its last token
as a short chunk of 1 + k rows, and every one of those rows gets logits, for verification. A step with
guesses, a **verification step**, runs from the same static buffers, in buckets of its own: its T rows
(1 + k for each sequence, k from 0 to K = ``num_speculative_tokens``, sequences of different k side by side)
are padded to a bucket of R rows (``verification_sizes``: the decode sizes, and each of them times 1 + K, so
that a step where every sequence brings K guesses pads nothing), and the bucket has R sequence slots, one per
row at most: the step's n sequences, then one per padding row (that row alone: it reads the first slot of
block 0 and writes nothing), then empty ones (no rows)::

    3 sequences with k = 2, 0, 1 -> T = 6 rows, bucket 8 (K = 4: query length 5 for the kernels' grid):
    input_ids        [a0 a1 a2 | b0 | c0 c1 | 0  0 ]
    slot_mapping     [s  s  s  | s  | s  s  | -1 -1]   padding writes no KV
    query_start_loc  0          3    4       6  7  8  8  8  8  each padding row its own sequence, then empty ones
    seq_lens         [41 17 90 | 1  1 | 0  0  0]      padding: one key (block 0's first slot), or no rows at all

The real rows are exactly the eager step's, in the same places, and attend exactly as they would there
(a row's keys are its own sequence's, up to its own position); the kernels' grid is fixed per bucket
(``max_query_len`` = 1 + K: a sequence with fewer rows leaves the programs past them idle). On CUDA each
verification bucket is captured too, so a step with guesses replays a graph as a decode step does. At
start-up the runner times steps of a few sizes, with and without guesses (``measure_cost``,
``measure_sequence_cost``): what a step's rows cost is what the speculation policy (``policy.py``) weighs
each guess against.

With tensor parallelism every rank has a runner, and rank 0 sends each step to the others before
running it itself (``worker.py``); every rank runs the same forward pass on its own slices of the model
(the model's collectives keep them in step), and the logits, gathered, arrive on rank 0 only. The ranks
never send each other the step's input tensors: its plain numbers are a few kilobytes, and each rank
builds its own tensors from them.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate, chain, pairwise
from pathlib import Path
from typing import NamedTuple

import torch

from common.device import keep_freed_memory

from .attention import AttentionMetadata, use_triton
from .block_manager import token_slots
from .config import EngineConfig
from .distributed import RanksOutOfStep, TPGroup
from .kv_cache import KVCache, budget_bytes
from .model import LlamaForCausalLM
from .policy import StepCost, fixed_cost, measure_step_cost
from .scheduler import Batch

log = logging.getLogger("llm-course")

# What a step costs, for the speculation policy: decode steps of r sequences of COST_CONTEXT tokens each, for r in
# COST_ROWS (straight lines between them; on a CPU the cost grows linearly past 16 rows, and each point costs
# start-up time: the five take about 2 s for SmolLM2-135M on 2 cores), each the best of COST_REPEATS runs.
COST_ROWS = (1, 2, 4, 16, 64)
COST_CONTEXT = 256
COST_REPEATS = 2
COST_GUESSING_SEQS = 8  # sequences in the step timed for what a sequence with guesses adds (measure_sequence_cost)
COST_ROWS_EACH = 5  # the most rows of one sequence in a timed step (1 + up to 4 guesses): room left past the context


@dataclass
class StepInput:
    """One step as plain numbers: everything ``execute`` needs, nothing of the engine's objects."""

    input_ids: list[int]  # [T]: every sequence's new tokens, end to end
    positions: list[int]  # [T]: each token's position in its own sequence
    slot_mapping: list[int]  # [T]: the cache slot each token's K/V goes to (-1: nowhere)
    query_start_loc: list[int]  # [B + 1]: where each sequence's new tokens start in T
    seq_lens: list[int]  # [B]: cached + new tokens of each sequence after this step
    block_tables: list[list[int]]  # [B][its blocks]: each sequence's own table, as long as it is (not padded)
    logits_indices: list[int]  # [R]: each sampling sequence's last row and its k guesses' rows (none mid-prompt)
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


class Bucket(NamedTuple):
    """A shape of step the static buffers run (and, on CUDA, a captured graph): ``rows`` rows in as many
    sequence slots, each sequence with at most ``query_len`` of them (1: a decode step; 1 + K: a verification)."""

    rows: int
    query_len: int


def verification_sizes(decode_sizes: list[int], query_len: int, most: int) -> list[int]:
    """The buckets a step with guesses is padded to, by rows, up to ``most``: the decode buckets' sizes from 2 rows
    on (a step with guesses has 2 rows or more), and each decode bucket's sequences with all their guesses
    (n x ``query_len`` rows), so that the commonest verification, every sequence with K guesses, pads nothing."""
    full = {n * query_len for n in decode_sizes if n * query_len <= most}
    return sorted({size for size in graph_batch_sizes(most) if size > 1} | full)


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` rows; None when none does (the step runs eagerly)."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def resolve_placeholders(input_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The step's input ids with every placeholder (-1 - row: a token the host has not read yet) swapped for the token
    in that row of ``sampled``, the tokens of the step in flight: on the device, in the device's order, so that this
    step runs after that one without the host waiting for either."""
    # input_ids: [T] int64, placeholders negative; sampled: [S] int64, S >= 1 -> [T]
    ### BEGIN SOLUTION 10.2
    rows = (-1 - input_ids).clamp(min=0)  # [T]: a placeholder's row; row 0 for a real id (not used)
    return torch.where(input_ids < 0, sampled[rows], input_ids)
    ### END SOLUTION


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
    """A step's inputs and output at fixed addresses, sized for the largest bucket: R rows, R sequence slots.

    A captured graph replays its kernels on exactly these tensors, so a step never allocates new ones:
    it copies its numbers in (``load``) and reads the output rows it needs. Every input is a view of one int32
    buffer (``inputs``, ``input_layout``), and has a twin in one CPU buffer (``staged``, pinned on CUDA; its views:
    ``staging``): a step writes its numbers into the twins, and one copy, without blocking the CPU, sends them all."""

    input_ids: torch.Tensor  # [R] int64, padding 0 (any valid token: its row is thrown away)
    positions: torch.Tensor  # [R] int64, padding 0
    slot_mapping: torch.Tensor  # [R] int64, padding -1: write no K/V
    query_start_loc: torch.Tensor  # [R + 1] int32: the step's, then one more row per padding row, then no more
    query_lens: torch.Tensor  # [R] int32: the sequence slots' rows (a decode bucket: all ones)
    seq_lens: torch.Tensor  # [R] int32, padding 0 (attend to nothing: zeros), or 1 in a verification bucket
    block_tables: torch.Tensor  # [R, W] int32, padding 0; W never changes (a graph bakes in the stride)
    logits_indices: torch.Tensor  # [R] int64: the rows whose logits the step needs, then 0
    hidden: torch.Tensor  # [R, hidden_size]: the forward pass's output
    inputs: torch.Tensor  # every input above but ``hidden``, end to end: the one buffer they are views of
    staged: torch.Tensor  # [same words] int32: the inputs' CPU twin (pinned on CUDA), what one copy sends
    staging: dict[str, torch.Tensor]  # each input's view of ``staged``, by name
    copied: torch.cuda.Event | None = None  # on CUDA: set when the last step's copy out of staging is done

    @classmethod
    def allocate(cls, max_rows: int, width: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> StaticBuffers:
        layout = input_layout(max_rows, width)
        words = sum(math.prod(shape) * kind.itemsize // 4 for _, kind, shape in layout)  # int32 words
        staged = torch.zeros(words, dtype=torch.int32, pin_memory=device.type == "cuda")
        staging = carve(staged, layout)
        staging["slot_mapping"].fill_(-1)  # padding: write no K/V
        staging["query_start_loc"].copy_(torch.arange(max_rows + 1))  # one token a row
        staging["query_lens"].fill_(1)
        inputs = torch.empty(words, dtype=torch.int32, device=device)
        inputs.copy_(staged)
        return cls(**carve(inputs, layout), hidden=torch.zeros(max_rows, hidden_size, dtype=dtype, device=device),
                   inputs=inputs, staged=staged, staging=staging)

    @property
    def width(self) -> int:
        return self.block_tables.shape[1]

    def load(self, step: StepInput, size: int, query_len: int = 1) -> None:
        """Rows [0, T) get the step's T rows, rows [T, size) padding; the sequence slots the step's sequences, then
        padding (``sequence_slots``); nothing of an earlier step stays. The block tables and the logits' rows too:
        every number the step needs is on its way before it runs."""
        n = len(step.input_ids)
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
        }
        ### END SOLUTION
        values |= sequence_slots(step, size, query_len)
        values["logits_indices"] = step.logits_indices + [0] * (size - len(step.logits_indices))
        for name, numbers in values.items():
            self.staging[name][: len(numbers)].copy_(torch.tensor(numbers, dtype=self.staging[name].dtype))
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

    def metadata(self, size: int, query_len: int = 1) -> AttentionMetadata:
        """The attention metadata of a bucket of ``size`` rows whose sequences have at most ``query_len`` rows each:
        views of the buffers, never copies, and a ``max_query_len`` fixed by the bucket, not by the step."""
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 query_lens=self.query_lens[:size], seq_lens=self.seq_lens[:size],
                                 block_tables=self.block_tables[:size], max_query_len=query_len,
                                 logits_indices=self.logits_indices[:size])


def sequence_slots(step: StepInput, size: int, query_len: int) -> dict[str, list[int]]:
    """The ``size`` sequence slots of a bucket of ``size`` rows: the step's n sequences, then one sequence of one row
    per padding row, then empty sequences (no rows; a verification step has fewer sequences than rows).

    A padding row's context is 0 in a decode bucket (the decode kernels give zeros) and 1 in a verification bucket
    (the extend kernel divides by the weights of the keys a row sees: one key, the first slot of block 0, keeps the
    row finite; what it reads there does not matter, its row is thrown away)."""
    num_rows, num_seqs = len(step.input_ids), len(step.seq_lens)
    starts = step.query_start_loc + list(range(num_rows + 1, size + 1)) + [size] * (num_rows - num_seqs)  # [size + 1]
    context = 0 if query_len == 1 else 1
    return {"query_start_loc": starts, "query_lens": [end - start for start, end in pairwise(starts)],
            "seq_lens": step.seq_lens + [context] * (size - num_rows) + [0] * (num_rows - num_seqs)}


class ModelRunner:
    """``num_speculative_tokens``: the most guesses K of a sequence in a step (0: no verification buckets); a step
    with guesses has at most ``max_num_batched_tokens`` rows (None: every sequence with all K guesses fits)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device, max_num_seqs: int, max_model_len: int, num_speculative_tokens: int = 0,
                 max_num_batched_tokens: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)  # the decode buckets, smallest first
        self.verify_query_len = 1 + num_speculative_tokens  # the most rows of one sequence in a step with guesses
        most = max_num_seqs * self.verify_query_len  # every sequence with all its guesses
        if max_num_batched_tokens is not None:
            most = min(most, max_num_batched_tokens)
        # The verification buckets, by rows; none without guesses.
        sizes = verification_sizes(self.sizes, self.verify_query_len, most)
        self.verify_sizes = sizes if num_speculative_tokens else []
        width = -(-max_model_len // kv_cache.shape.block_size)  # blocks of the longest possible sequence
        dtype = model.model.embed_tokens.weight.dtype
        rows = max([*self.sizes, *self.verify_sizes])
        self.buffers = StaticBuffers.allocate(rows, width, model.config.hidden_size, dtype, device)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}  # bucket -> its captured step (CUDA only)
        self.capture_seconds: float | None = None  # how long capturing the graphs took; None: not captured
        self.graph_memory_bytes = 0  # what the captured graphs hold on the GPU
        self.step_cost: StepCost | None = None  # a step with guesses, by rows (None: not measured, no cost policy)
        self.decode_cost: StepCost | None = None  # a step without guesses, by rows (None: not measured)
        self.sequence_cost = 0.0  # seconds a sequence with guesses adds beyond its rows (``measure_sequence_cost``)
        self.tp: TPGroup = model.tp

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
            end = start + seq.num_scheduled_tokens  # a decode: 1 + k (its guesses); a chunk: part of the prompt
            input_ids.extend(seq.tokens(start, end) + seq.draft_ids[: max(0, end - seq.num_tokens)])
            positions.extend(range(start, end))
            slot_mapping.extend(token_slots(seq.block_table, self.block_size, start, end))
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)  # what its queries see: everything cached, and this step's tokens
            if seq.samples_next_token:  # its last token's row, and one row per guess
                logits_indices.extend(range(query_start_loc[-1] - 1 - len(seq.draft_ids), query_start_loc[-1]))
            ### END SOLUTION
            # Prompt logprobs (echo): the row at position p predicts prompt token p + 1, for p < len(prompt) - 1.
            scored = max(0, min(end, len(seq.prompt_ids) - 1) - start) if seq.needs_prompt_logprobs else 0
            prompt_logits_indices.extend(range(query_start_loc[-2], query_start_loc[-2] + scored))
            num_prompt_logits.append(scored)
        block_tables = [seq.block_table.copy() for seq in batch.seqs]  # ragged: padded where they become a tensor
        return StepInput(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_indices,
                         prompt_logits_indices=prompt_logits_indices, num_prompt_logits=num_prompt_logits)

    def device_input_ids(self, step: StepInput, sampled: torch.Tensor | None) -> torch.Tensor | None:
        """The step's input ids on the device with their placeholders resolved from ``sampled`` (the tokens of the step
        in flight), for ``execute``; None when it has no placeholder (``execute`` then sends ``step.input_ids``)."""
        if sampled is None or min(step.input_ids) >= 0:
            return None
        return resolve_placeholders(self._tensor(step.input_ids, torch.int64), sampled)

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

    def bucket(self, step: StepInput) -> Bucket | None:
        """The bucket a step runs in from the static buffers, or None: it runs eagerly (a sequence with more rows
        than 1 + K, a long prompt chunk; prompt scoring; more rows than the largest bucket). A step of one row a
        sequence is a decode step; one with up to 1 + K rows a sequence, guesses or short chunks, a verification."""
        if step.prompt_logits_indices:
            return None
        if len(step.input_ids) == len(step.seq_lens):  # T == B: every row is one token
            size = bucket_for(len(step.seq_lens), self.sizes)
            return None if size is None else Bucket(size, 1)
        longest = max(end - start for start, end in pairwise(step.query_start_loc))
        size = bucket_for(len(step.input_ids), self.verify_sizes)
        return None if size is None or longest > self.verify_query_len else Bucket(size, self.verify_query_len)

    @torch.inference_mode()
    def execute(self, step: StepInput,
                input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's part of one forward pass for the whole step (every rank runs the same step).

        Returns the logits of the last token of each sequence that samples and of its guesses,
        [R, V] (R may be 0: a step of mid-prompt chunks only), and the logits of the prompt rows that score
        prompts, [M, V] (None when no sequence asked). Only those rows go through the output projection, and
        separately, so that nobody's sampled token depends on them. On ranks > 0 the logits are None: rank 0
        gathers them.

        ``input_ids``: the step's tokens already on the device ([T] int64), in place of ``step.input_ids`` (then
        placeholders): a draft model's guesses go in without being read back to the CPU first.
        """
        try:
            return self.run_step(step, input_ids)
        except Exception as exc:
            if self.tp.size == 1:
                raise
            # The other ranks are inside some collective this one will never join (or one of them is gone):
            # the ranks are out of step for good, and the engine cannot go on.
            raise RanksOutOfStep(f"rank {self.tp.rank}: {type(exc).__name__}: {exc}") from exc

    def run_step(self, step: StepInput,
                 input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's part of the step: from the static buffers when it fits a bucket, else eagerly."""
        bucket = self.bucket(step)
        if bucket is not None:
            hidden = self.run_static(step, bucket, input_ids)  # [T, hidden]: the real rows of the bucket
            rows = self.buffers.logits_indices[: len(step.logits_indices)]  # [R]: loaded with the step's inputs
            return self.model.compute_logits(hidden[rows]), None  # every rank computes its logit slice
        return self.run_eager(step, input_ids)

    def run_static(self, step: StepInput, bucket: Bucket, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A step from the static buffers, padded to ``bucket``: replayed if captured, else eager. ``input_ids``:
        the step's tokens on the device, copied over the loaded placeholders (after them, on the same stream)."""
        self.buffers.load(step, *bucket)
        if input_ids is not None:
            self.buffers.input_ids[: len(step.input_ids)].copy_(input_ids)
        if bucket in self.graphs:
            self.graphs[bucket].replay()  # every kernel of the forward pass, one launch, on the buffers
        else:
            self.forward_static(*bucket)
        return self.buffers.hidden[: len(step.input_ids)]

    def forward_static(self, size: int, query_len: int = 1) -> None:
        """The forward pass on the first ``size`` rows of the static buffers (a bucket whose sequences have at most
        ``query_len`` rows each), its output written into them. Exactly what a graph captures: no new inputs, no
        host reads, no shape that depends on the data."""
        buffers = self.buffers
        hidden = self.model(buffers.input_ids[:size], buffers.positions[:size], self.kv_cache,
                            buffers.metadata(size, query_len))  # [size, hidden]
        buffers.hidden[:size].copy_(hidden)

    def run_eager(self, step: StepInput,
                  input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Any step, with tensors built for it: the path of prompt chunks, guesses, mixed steps and prompt scoring."""
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
        if input_ids is None:
            input_ids = self._tensor(step.input_ids, torch.int64)  # [T]
        positions = self._tensor(step.positions, torch.int64)  # [T]
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]
        logits = self.model.compute_logits(hidden[meta.logits_indices])  # [R, V] float32
        prompt_logits = None
        if step.prompt_logits_indices:
            prompt_logits = self.model.compute_logits(hidden[self._tensor(step.prompt_logits_indices, torch.int64)])
        return logits, prompt_logits

    @torch.inference_mode()
    def measure_cost(self, rows: list[int], guesses: int = 0) -> StepCost:
        """The seconds of a step of r rows for each r of ``rows``, as ``execute`` runs it: decoding sequences with
        ``COST_CONTEXT`` tokens in the cache, one row each, except that with ``guesses`` the first brings that many
        guesses. One sequence with guesses makes the step a verification: its bucket's extend attention (on a
        CPU, a call of its own for that sequence, the decode rows sharing another), where a decode step has the
        decode kernel; on CUDA both replay a graph. Each further sequence with guesses adds what
        ``measure_sequence_cost`` times."""
        def run(num_rows: int) -> None:
            first = min(num_rows, 1 + guesses)
            step = dummy_step([first] + [1] * (num_rows - first), self.cost_context, self.kv_cache.num_blocks,
                              self.block_size)
            self.execute(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        return measure_step_cost(run, rows, COST_REPEATS)

    @torch.inference_mode()
    def measure_sequence_cost(self, num_seqs: int, k: int, step_cost: StepCost) -> float:
        """What each sequence with k guesses after the first adds to a step beyond the cost of its 1 + k rows
        (``step_cost``, whose steps have one such sequence): a step of ``num_seqs`` of them as ``execute`` runs it,
        timed (best of COST_REPEATS after an untimed run), less what ``step_cost`` gives for the rows it ran (its
        bucket's, padding included)."""
        step = dummy_step([1 + k] * num_seqs, self.cost_context, self.kv_cache.num_blocks, self.block_size)

        def run(_: int) -> None:
            self.execute(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        seconds = measure_step_cost(run, [num_seqs], COST_REPEATS).seconds(num_seqs)
        bucket = self.bucket(step)
        rows = len(step.input_ids) if bucket is None else bucket.rows
        return max(0.0, seconds - step_cost.seconds(rows)) / max(1, num_seqs - 1)

    @property
    def cost_context(self) -> int:
        """The cached tokens of each sequence in the steps timed for the policy."""
        return min(COST_CONTEXT, self.buffers.width * self.block_size - 1 - COST_ROWS_EACH)

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket, decode and verification, the most rows first."""
        decode = [Bucket(size, 1) for size in self.sizes]
        verify = [Bucket(size, self.verify_query_len) for size in self.verify_sizes]
        return sorted(decode + verify, reverse=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's step, decode and verification, into a CUDA graph; keep the seconds it took and
        the bytes of GPU memory it took (the graphs' shared pool: the activations of the largest bucket, mostly).

        Largest first, all into one memory pool: the largest graph's activations size the pool and every
        smaller one reuses them. Each bucket runs once eagerly before its capture, so that lazy work
        (Triton's compilation and tuning, cuBLAS's workspace) happens outside the graph. The buffers hold
        padding only (slot -1; context 0, or block 0's first slot): capturing writes no K/V."""
        assert self.device.type == "cuda" and use_triton(self.device), "CUDA graphs need CUDA and the Triton kernels"
        # What this process's allocator reserves for the graphs' pool (the device's free memory would also move
        # with every other process on the GPU). Capturing empties the allocator's cache first, so empty it here
        # too: what it held before must not count against the graphs.
        torch.cuda.empty_cache()
        start, reserved_before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = None
        for bucket in self.buckets:
            self.buffers.load(StepInput([], [], [], [0], [], [], [], [], []), *bucket)  # all padding
            self.forward_static(*bucket)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.forward_static(*bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - reserved_before


# --- building a runner --------------------------------------------------------------------------------


def start_runner(config: EngineConfig, model: LlamaForCausalLM, device: torch.device, max_num_batched_tokens: int,
                 draft_bytes_per_block: int = 0) -> ModelRunner:
    """The model runner with its KV-cache pool, warmed up, its graphs captured: what the engine builds once
    the weights are loaded.

    The pool comes after the weights, so that on CUDA it takes a share of what they left; and after one run
    of the largest step, whose activations it must leave room for.

    ``draft_bytes_per_block``: a draft model keeps its own K/V in a second pool of as many blocks, which the
    budget pays for too.

    Every rank runs this same function: the forward passes in it hold all-reduces and ``tp.min`` is one more
    collective, so the ranks' start-up collectives line up one for one."""
    max_model_len, dtype = model.config.max_position_embeddings, model.model.embed_tokens.weight.dtype
    shape = model.config.cache_shape(config.block_size, dtype, model.tp.size)  # this rank's KV heads
    if device.type == "cuda":  # what the largest step's activations take, before the pool takes the rest
        run_dummy_step(model, KVCache.allocate(shape, shape.bytes_per_block, device), device,
                       min(max_num_batched_tokens, max_model_len))
    if device.type == "cpu":  # attention's gathers allocate tens of MB per layer and step: keep them
        keep_freed_memory()
    freed = model.num_unquantized_bytes - model.num_weight_bytes  # what quantized weights left to the pool
    budget = budget_bytes(device, config.kv_cache_mb, config.gpu_memory_utilization, freed)
    num_blocks = budget // (shape.bytes_per_block + draft_bytes_per_block)
    num_blocks = model.tp.min(num_blocks)  # one block table serves every rank: each must have every block
    kv_cache = KVCache.allocate(shape, num_blocks * shape.bytes_per_block, device)
    guesses = config.num_speculative_tokens if config.speculative != "off" else 0
    runner = ModelRunner(model, kv_cache, config.block_size, device, config.max_num_seqs, max_model_len, guesses,
                         max_num_batched_tokens)
    # Warm up: compile every kernel now (a decode step and an extend step), not in a user's request. On CUDA the
    # extend kernel is tuned apart for each size of query (``query_rows_bucket``): 2 rows take the bucket of 16, the
    # largest step above the last, and 100 and 1,000 rows the two between, so that no served step pays for a tuning.
    most = min(max_num_batched_tokens, max_model_len)
    between = [n for n in (100, 1000) if n <= most] if device.type == "cuda" else []
    for num_tokens in (1, 2, *between):
        run_dummy_step(model, kv_cache, device, num_tokens)
    if captures_graphs(device, config.enforce_eager):
        runner.capture()
        log.info("captured the decode step for batch sizes %s and the verification step for rows %s in %.1f s "
                 "(%.0f MiB)", runner.sizes, runner.verify_sizes, runner.capture_seconds,
                 runner.graph_memory_bytes / 2**20)
    weighs_costs = (config.speculative != "off" and config.num_speculative_tokens > 0
                    and config.speculative_policy == "cost")
    if weighs_costs and config.step_costs:  # measured before, by step_bench: no timing here, the same plan every start
        cost = fixed_cost(Path(config.step_costs), replayed=captures_graphs(device, config.enforce_eager))
        runner.decode_cost, runner.step_cost, runner.sequence_cost = cost.decode, cost.verify, cost.per_sequence
    elif weighs_costs:
        # What the policy weighs guesses against: steps of up to every sequence with all its guesses.
        most = min(config.max_num_seqs * (1 + config.num_speculative_tokens), max_num_batched_tokens)
        k = min(config.num_speculative_tokens, COST_ROWS_EACH - 1)
        runner.decode_cost = decode = runner.measure_cost(cost_rows(most))
        # A step with guesses costs a plain step of as many rows plus the price of its verification attention (the
        # extend kernel where a decode step has the decode kernel; on a CPU, a call of its own for the sequence with
        # guesses), the same at every size: measured at two verification buckets' sizes (no padding in either), so
        # that noise in one point cannot bend the line the policy extends.
        shifted = runner.measure_cost([bucket_for(rows, runner.verify_sizes) or rows
                                       for rows in (1 + k, max(1 + k, min(most, COST_ROWS[-2])))], guesses=k)
        switch = max(0.0, statistics.median(seconds - decode.seconds(rows) for rows, seconds in shifted.points))
        runner.step_cost = StepCost(tuple((rows, seconds + switch) for rows, seconds in decode.points))
        runner.sequence_cost = runner.measure_sequence_cost(min(COST_GUESSING_SEQS, config.max_num_seqs), k,
                                                            runner.step_cost)
    return runner


def captures_graphs(device: torch.device, enforce_eager: bool) -> bool:
    """Whether a runner on ``device`` captures its buckets: on CUDA, with the Triton kernels, unless
    ``enforce_eager``."""
    return device.type == "cuda" and use_triton(device) and not enforce_eager


def cost_rows(most: int) -> list[int]:
    """The batch sizes to time for steps of up to ``most`` rows: those of COST_ROWS below it, and ``most`` itself
    unless it is past them (the cost goes on in a straight line there)."""
    return sorted({rows for rows in COST_ROWS if rows < most} | {min(most, COST_ROWS[-1])})


def dummy_step(rows: list[int], context: int, num_blocks: int, block_size: int) -> StepInput:
    """A step of sequences with ``context`` tokens each in the cache and ``rows[i]`` new ones (1: a decode; 1 + k: a
    verification, every row scored): it writes nothing (slot -1) and reads blocks 0, 1, 2... in turn (their contents
    do not change the time)."""
    width = (context + max(rows) - 1) // block_size + 1
    tables = [[(s * width + j) % num_blocks for j in range(width)] for s in range(len(rows))]
    starts = [0, *accumulate(rows)]
    return StepInput(input_ids=[0] * starts[-1], positions=[context + i for n in rows for i in range(n)],
                     slot_mapping=[-1] * starts[-1], query_start_loc=starts, seq_lens=[context + n for n in rows],
                     block_tables=tables, logits_indices=list(range(starts[-1])), prompt_logits_indices=[],
                     num_prompt_logits=[0] * len(rows))


def run_dummy_step(model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, num_tokens: int) -> None:
    """One forward pass of ``num_tokens`` tokens of one sequence that writes nothing (slot -1) and reads
    block 0 for every position: to compile the kernels, and to measure the activations' peak."""
    inputs = StepInput(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                       slot_mapping=[-1] * num_tokens, query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
                       block_tables=[[0] * -(-num_tokens // kv_cache.shape.block_size)],
                       logits_indices=[num_tokens - 1], prompt_logits_indices=[], num_prompt_logits=[0])
    runner = ModelRunner(model, kv_cache, kv_cache.shape.block_size, device, 1, model.config.max_position_embeddings)
    runner.execute(inputs)
