"""The engine: load a model and generate text with the two phases of inference written out.

Prefill runs the whole prompt through the model in one forward pass and fills the KV cache.
Decode then feeds one token at a time, reusing the cache so that each step computes keys and
values for the new token only. ``model.generate()`` would hide both; here they are the lesson.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache

from common.device import pick_device, pick_dtype
from common.weights import load_tokenizer, resolve_model

from .config import EngineConfig
from .sampler import SamplingParams, make_generator, sample


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    prefill_ms: float
    decode_ms_per_token: float  # 0.0 when only one token was generated
    kv_cache_bytes: int

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


def kv_cache_bytes(cache: Cache) -> int:
    """Bytes held by the KV cache: every layer's K and V tensors, [B, kv_heads, T, head_dim] each."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


class Engine:
    """One model, one request at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        model_dir = resolve_model(config.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, local_files_only=True
        ).to(self.device)
        self.model.eval()  # inference mode for every layer (no dropout)
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.eos_token_ids = self._eos_token_ids()

    def _eos_token_ids(self) -> set[int]:
        """EOS ids from the generation config (may be a list) and the tokenizer."""
        ids = self.model.generation_config.eos_token_id
        eos = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    # --- text <-> token ids ---------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the conversation with the model's chat template, ready for the assistant's turn."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids  # the template has them

    # --- the two phases -------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, Cache]:
        """Run the whole prompt at once; return the last position's logits and the filled cache."""
        input_ids = torch.tensor([prompt_ids], device=self.device)  # [1, T]
        out = self.model(input_ids=input_ids, use_cache=True)
        return out.logits[0, -1], out.past_key_values  # logits: [V]

    def decode_one_token(self, token_id: int, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """Run one new token against the cache; the cache grows by one position per layer."""
        ### BEGIN SOLUTION 1.3
        input_ids = torch.tensor([[token_id]], device=self.device)  # [1, 1]
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return out.logits[0, -1], out.past_key_values  # logits: [V]
        ### END SOLUTION

    # --- the generation loop --------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Prefill, then decode one token per step until EOS, a stop string or ``max_tokens``."""
        generator = make_generator(params.seed, self.device)
        output_ids: list[int] = []
        text, finish_reason = "", "length"

        start = time.perf_counter()
        logits, cache = self.prefill(prompt_ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # kernels run asynchronously; wait before reading the clock
        prefill_ms = (time.perf_counter() - start) * 1000

        decode_start = time.perf_counter()
        ### BEGIN SOLUTION 1.4
        while True:
            token_id = sample(logits, params, generator)
            output_ids.append(token_id)
            if token_id in self.eos_token_ids and not params.ignore_eos:
                finish_reason = "stop"
                break
            # Decode the whole output again each step: simple, and quadratic. Stage 02 fixes it.
            text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
            cut = find_stop(text, params.stop)
            if cut is not None:
                text, finish_reason = text[:cut], "stop"
                break
            if len(output_ids) == params.max_tokens:
                break
            logits, cache = self.decode_one_token(token_id, cache)
        ### END SOLUTION
        decode_steps = max(len(output_ids) - 1, 0)  # the first token came from prefill
        decode_ms = (time.perf_counter() - decode_start) * 1000

        return GenerationResult(
            text=text,
            prompt_tokens=len(prompt_ids),
            output_ids=output_ids,
            finish_reason=finish_reason,
            prefill_ms=prefill_ms,
            decode_ms_per_token=decode_ms / decode_steps if decode_steps else 0.0,
            kv_cache_bytes=kv_cache_bytes(cache),
        )


def find_stop(text: str, stop: list[str]) -> int | None:
    """Index where the earliest stop string begins in ``text``, or None."""
    hits = [i for s in stop if (i := text.find(s)) != -1]
    return min(hits) if hits else None
