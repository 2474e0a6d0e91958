"""The engine: the stage's own model, a paged KV cache, and the streaming generation loop.

Stage 02's loop is unchanged in shape (prefill, then one decode step per token, yielding each token
as it is sampled), but the KV cache is no longer Hugging Face's per-request tensor. At start-up the
engine reserves one pool of blocks for every request it will ever serve; a request's cache is the
list of blocks in its block table, taken one at a time as it grows and all given back when it ends.
``AsyncEngine`` still runs one request at a time: the pool can hold many sequences, and stage 04
will use that to batch them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from common.device import pick_device, pick_dtype
from common.trace import RequestTrace
from common.weights import load_tokenizer, resolve_model

from .attention import AttentionMetadata, use_triton
from .block_manager import BlockManager, token_slots
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache import KVCache, budget_bytes
from .model import LlamaForCausalLM
from .sampler import SamplingParams, compute_logprobs, make_generator, sample
from .sequence import RequestOutput
from .stats import KVBlockStats

WARM_UP_TOKENS = 256  # the start-up's extend step: a typical prompt, which the kernel's tiles are tuned on


class InvalidRequest(ValueError):
    """The engine cannot take this request (token ids outside the vocabulary, too long): a 400."""


class EngineStopped(RuntimeError):
    """The engine thread has exited: nothing it held or was sent will ever be served."""


class Engine:
    """One model, one KV-cache pool, one request at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        model_dir = resolve_model(config.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=self.dtype, device=self.device)
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        # The pool is allocated after the weights, so that on CUDA it takes a share of what they left.
        shape = self.model.config.cache_shape(config.block_size, self.dtype)
        budget = budget_bytes(self.device, config.kv_cache_mb, config.gpu_memory_utilization)
        self.kv_cache = KVCache.allocate(shape, budget, self.device)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size)
        self.warm_up()

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole pool can hold: the most any one sequence can ever reach."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def kv_blocks(self) -> KVBlockStats:
        blocks = self.block_manager
        return KVBlockStats(blocks.num_blocks, blocks.num_used, blocks.num_free, blocks.block_size)

    # --- text <-> token ids ---------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the conversation with the model's chat template, ready for the assistant's turn."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids  # the template has them

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what would break the model, whoever calls it (the server checks too)."""
        vocab_size = self.model.config.vocab_size
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if bad := [i for i in [*prompt_ids, *params.logit_bias] if not 0 <= i < vocab_size]:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens exceed the context "
                                 f"length of {self.max_model_len}")
        # A sequence that outgrew the whole pool could never run.
        if len(prompt_ids) + params.max_tokens > self.kv_capacity_tokens:
            raise InvalidRequest(f"{len(prompt_ids)} prompt + {params.max_tokens} new tokens exceed the "
                                 f"{self.kv_capacity_tokens} tokens of the KV cache")

    # --- the two phases -------------------------------------------------------------------
    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _forward(self, token_ids: list[int], start: int, block_table: list[int]) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start...`` of one sequence, whose first ``start`` tokens are
        in the cache already; write their K/V to the pool and return their hidden states."""
        end = start + len(token_ids)
        self.block_manager.grow(block_table, end)  # a new block only when the last one is full
        slots = token_slots(block_table, self.block_manager.block_size, start, end)
        return self._run(token_ids, start, block_table, slots)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the kernels now rather than in a user's request: a decode step and an extend step that
        read block 0 for every position and write nowhere (slot -1). The extend step is prompt-sized, since
        the Triton kernel's autotuner picks its tiles on that first call (the PyTorch reference compiles
        nothing, and two tokens do)."""
        block_size = self.block_manager.block_size
        extend_tokens = WARM_UP_TOKENS if use_triton(self.device) else 2
        for num_tokens in (1, min(extend_tokens, self.max_model_len)):
            self._run([0] * num_tokens, 0, [0] * -(-num_tokens // block_size), [-1] * num_tokens)

    def _run(self, token_ids: list[int], start: int, block_table: list[int], slot_mapping: list[int]) -> torch.Tensor:
        """One forward pass of one sequence's tokens at positions ``start...``; their hidden states."""
        end = start + len(token_ids)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            query_start_loc=self._tensor([0, len(token_ids)]),  # one sequence in this stage
            query_lens=self._tensor([len(token_ids)]),
            seq_lens=self._tensor([end]),
            block_tables=self._tensor([block_table]),  # [1, num_blocks]
            max_query_len=len(token_ids),
            logits_indices=self._tensor([len(token_ids) - 1], torch.int64),
        )
        input_ids = self._tensor(token_ids, torch.int64)  # [T]
        positions = torch.arange(start, end, device=self.device)  # [T]
        return self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]

    def prefill(self, prompt_ids: list[int], block_table: list[int],
                score_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the whole prompt at once, writing its K/V into the sequence's blocks.

        Returns the last position's logits, [V], which predict the first new token. Only with
        ``score_prompt`` (prompt logprobs) do the other T - 1 rows go through the output projection
        too, [T - 1, V]: separately, so that the last row's logits are the same either way.
        """
        hidden = self._forward(prompt_ids, 0, block_table)  # [T, hidden]
        prompt_logits = self.model.compute_logits(hidden[:-1]) if score_prompt else None
        return self.model.compute_logits(hidden[-1:])[0], prompt_logits

    def decode_one_token(self, token_id: int, position: int, block_table: list[int]) -> torch.Tensor:
        """Run one new token at ``position``, reading the cache through the block table; logits: [V]."""
        hidden = self._forward([token_id], position, block_table)  # [1, hidden]
        return self.model.compute_logits(hidden)[0]

    # --- the generation loop --------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 trace: RequestTrace | None = None) -> Iterator[RequestOutput]:
        """Prefill, then decode one token per step until EOS, a stop string or ``max_tokens``.

        Yields after every token. Whoever iterates may simply stop (a client went away): closing
        the generator runs the ``finally``, which hands the sequence's blocks back to the pool.
        """
        self.check_request(prompt_ids, params)
        generator = make_generator(params.seed, self.device)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        output_ids: list[int] = []
        trace = trace or RequestTrace()  # spans, when the server runs with --trace
        block_table: list[int] = []
        try:
            with trace.span("prefill"):
                logits, prompt_logits = self.prefill(prompt_ids, block_table, params.prompt_logprobs is not None)
            prompt_logprobs = None  # paid for only when asked (echo): T - 1 more rows of logits
            if prompt_logits is not None:
                prompt_logprobs = compute_logprobs(prompt_logits, prompt_ids[1:], params.prompt_logprobs)
            if params.max_tokens == 0:  # only the prompt was to be scored (echo)
                yield RequestOutput(request_id, [], "", "length", len(prompt_ids), 0, [], prompt_logprobs)
                return
            while True:
                token_id = sample(logits, params, generator, output_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = compute_logprobs(logits[None], [token_id], params.logprobs)
                output_ids.append(token_id)
                finish_reason = None
                with trace.span("detokenize"):  # the text of the token, and the stop checks
                    if token_id in self.eos_token_ids and not params.ignore_eos:
                        text, finish_reason = detokenizer.flush(), "stop"
                    else:
                        text = detokenizer.add(token_id)
                        if detokenizer.stopped:
                            finish_reason = "stop"
                        elif len(output_ids) == params.max_tokens:
                            text, finish_reason = text + detokenizer.flush(), "length"
                yield RequestOutput(request_id, [token_id], text, finish_reason, len(prompt_ids), len(output_ids),
                                    logprobs, prompt_logprobs)
                if finish_reason is not None:
                    return
                prompt_logprobs = None  # the first output carries them
                position = len(prompt_ids) + len(output_ids) - 1  # the sampled token's own position
                with trace.span("decode"):
                    logits = self.decode_one_token(token_id, position, block_table)
        finally:
            self.block_manager.free(block_table)
