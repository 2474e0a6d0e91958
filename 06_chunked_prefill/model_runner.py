"""The model runner, in two halves: ``prepare`` a scheduled batch as plain numbers, ``execute`` it.

The model takes one step's tokens laid end to end, ``input_ids: [T]`` and ``positions: [T]``, with
no padding. One step mixes both kinds of rows: every decoding sequence contributes its one new token,
and every sequence being prefilled its chunk, the ``num_scheduled_tokens`` tokens after the
``num_computed_tokens`` already in the cache (its cached prefix and its earlier chunks)::

    tokens   | d0 | d1 | d2 | p0 p0 p0 p0 p0 p0 | p1 p1 p1 |      3 decodes, 2 chunks: T = 12
    query_start_loc  0    1    2    3                   9          12
    seq_lens        41   17   90   16 + 6 = 22         0 + 3 = 3  (cached + new)

``AttentionMetadata`` tells attention where each sequence's tokens are, where their K/V go (the slot
mapping) and where each sequence's cache lives (its block table). Only the rows that end a sequence's
known tokens are sampled: a chunk that stops part-way through a prompt has no next token to predict.

Why two halves: ``prepare`` reads the engine's objects (sequences, block tables) and produces a
``StepInput`` of lists and numbers only; ``execute`` turns it into tensors and runs the model. What
sits between them is where later stages work: CUDA graphs copy the StepInput into static buffers
(stage 07), and tensor-parallel rank 0 broadcasts it to the other ranks (stage 09).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from common.device import keep_freed_memory

from .attention import AttentionMetadata
from .block_manager import token_slots
from .config import EngineConfig
from .kv_cache import KVCache, budget_bytes
from .model import LlamaForCausalLM
from .scheduler import Batch


@dataclass
class StepInput:
    """One step as plain numbers: everything ``execute`` needs, nothing of the engine's objects."""

    input_ids: list[int]  # [T]: every sequence's new tokens, end to end
    positions: list[int]  # [T]: each token's position in its own sequence
    slot_mapping: list[int]  # [T]: the cache slot each token's K/V goes to (-1: nowhere)
    query_start_loc: list[int]  # [B + 1]: where each sequence's new tokens start in T
    seq_lens: list[int]  # [B]: cached + new tokens of each sequence after this step
    block_tables: list[list[int]]  # [B][max_blocks]: each sequence's blocks, padded with block 0
    logits_indices: list[int]  # [S]: the last row of each sequence that samples (not a mid-prompt chunk)
    prompt_logits_indices: list[int]  # the rows that score a prompt's next token, for the sequences that asked (echo)
    num_prompt_logits: list[int]  # [B]: how many of those rows belong to each sequence (0 for most)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

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
        width = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
        return StepInput(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_indices,
                         prompt_logits_indices=prompt_logits_indices, num_prompt_logits=num_prompt_logits)

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass for the whole step.

        Returns the logits of the last token of each sequence that samples, [S, V] (S may be 0: a step of
        mid-prompt chunks only), and the logits of the prompt rows that score prompts, [M, V] (None when no
        sequence asked). Only those rows go through the output projection, and separately, so that nobody's
        sampled token depends on them.
        """
        query_lens = [end - start for start, end in pairwise(step.query_start_loc)]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(step.slot_mapping, torch.int64),
            query_start_loc=self._tensor(step.query_start_loc),
            query_lens=self._tensor(query_lens),
            seq_lens=self._tensor(step.seq_lens),
            block_tables=self._tensor(step.block_tables),
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


# --- building a runner --------------------------------------------------------------------------------


def start_runner(config: EngineConfig, model: LlamaForCausalLM, device: torch.device,
                 max_num_batched_tokens: int) -> ModelRunner:
    """The model runner with its KV-cache pool, warmed up: what the engine builds once the weights are
    loaded.

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
    runner = ModelRunner(model, kv_cache, config.block_size, device)
    # Warm up: compile every kernel now (a decode step and an extend step), not in a user's request.
    for num_tokens in (1, 2):
        run_dummy_step(model, kv_cache, device, num_tokens)
    return runner


def run_dummy_step(model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, num_tokens: int) -> None:
    """One forward pass of ``num_tokens`` tokens of one sequence that writes nothing (slot -1) and reads
    block 0 for every position: to compile the kernels, and to measure the activations' peak."""
    inputs = StepInput(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                       slot_mapping=[-1] * num_tokens, query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
                       block_tables=[[0] * -(-num_tokens // kv_cache.shape.block_size)],
                       logits_indices=[num_tokens - 1], prompt_logits_indices=[], num_prompt_logits=[0])
    ModelRunner(model, kv_cache, kv_cache.shape.block_size, device).execute(inputs)
