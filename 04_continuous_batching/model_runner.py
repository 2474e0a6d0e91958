"""The model runner: turns a scheduled batch into the flat tensors one forward pass needs.

The model takes one step's tokens laid end to end, ``input_ids: [T]`` and ``positions: [T]``, with
no padding. For a prefill, T is the sum of the prompt lengths; for a decode, T is the number of
sequences (one token each). ``AttentionMetadata`` tells attention where each sequence's tokens are,
where their K/V go (the slot mapping) and where each sequence's cache lives (its block table).
"""

from __future__ import annotations

import torch

from .attention import AttentionMetadata
from .block_manager import BlockManager
from .kv_cache import KVCache
from .model import LlamaForCausalLM
from .scheduler import Batch
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_manager: BlockManager,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.device = device

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Every sequence's block table, padded with block 0 to the longest: [B, max_blocks] int32."""
        width = max(len(seq.block_table) for seq in seqs)
        return self._tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs])

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Whole prompts, end to end: input_ids and positions [T], and the ragged-batch metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_seqlens = [0]
        ### BEGIN SOLUTION 4.3
        for seq in seqs:
            n = seq.num_tokens  # a preempted sequence recomputes its output too
            input_ids.extend(seq.token_ids)
            positions.extend(range(n))
            slot_mapping.extend(self.block_manager.slot_mapping(seq.block_table, 0, n))
            cu_seqlens.append(cu_seqlens[-1] + n)
        ### END SOLUTION
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            block_tables=self._block_tables(seqs),
            context_lens=self._tensor([seq.num_tokens for seq in seqs]),
            cu_seqlens=self._tensor(cu_seqlens),
            max_seqlen=max(seq.num_tokens for seq in seqs),
        )
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Each sequence's last token (not in the cache yet), at its own position: [B] each."""
        positions = [seq.num_tokens - 1 for seq in seqs]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._tensor([self.block_manager.slot_mapping(seq.block_table, p, p + 1)[0]
                                       for seq, p in zip(seqs, positions, strict=True)], torch.int64),
            block_tables=self._block_tables(seqs),
            context_lens=self._tensor([seq.num_tokens for seq in seqs]),
            cu_seqlens=self._tensor(list(range(len(seqs) + 1))),
            max_seqlen=1,
        )
        input_ids = [seq.last_token_id for seq in seqs]
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta

    @torch.inference_mode()
    def run(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One forward pass for the whole batch.

        Returns the logits of each sequence's last token, [B, V], and for the sequences whose prompt
        logprobs were asked for, the logits of their other prompt positions, [n - 1, V] by request id.
        Only those rows go through the output projection: nobody else pays for prompt logprobs.
        """
        prepare = self.prepare_prefill if batch.is_prefill else self.prepare_decode
        input_ids, positions, meta = prepare(batch.seqs)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]
        last = meta.cu_seqlens[1:].long() - 1  # each sequence's last token in the step: [B]
        logits = self.model.compute_logits(hidden[last])  # [B, V] float32
        prompt_logits = {}
        if batch.is_prefill:
            for seq, start in zip(batch.seqs, meta.cu_seqlens[:-1].tolist(), strict=True):
                if seq.needs_prompt_logprobs:
                    rows = hidden[start : start + len(seq.prompt_ids) - 1]  # [n - 1, hidden]
                    prompt_logits[seq.request_id] = self.model.compute_logits(rows)
        return logits, prompt_logits
