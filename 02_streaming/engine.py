"""The engine: a model and the generation loop, now yielding every token the moment it is sampled.

``Engine.generate`` is stage 01's loop turned into a generator: the caller gets each token
(with its safe-to-send text) before the next decode step starts. ``AsyncEngine`` runs that loop
on its own thread, one request at a time in arrival order, and hands tokens to the asyncio
event loop that serves HTTP, so the server stays responsive while the model computes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache

from common.device import pick_device, pick_dtype
from common.trace import RequestTrace
from common.weights import load_tokenizer, resolve_model

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .sampler import SamplingParams, compute_logprobs, make_generator, sample
from .sequence import RequestOutput


class InvalidRequest(ValueError):
    """The engine cannot take this request (token ids outside the vocabulary, too long): a 400."""


class EngineStopped(RuntimeError):
    """The engine thread has exited: nothing it held or was sent will ever be served."""


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

    # --- the two phases -------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, Cache]:
        """Run the whole prompt at once; return every position's logits and the filled cache.

        Hugging Face computes logits for all T positions: the last predicts the first new token, the
        others are what prompt logprobs (``echo``) score.
        """
        input_ids = torch.tensor([prompt_ids], device=self.device)  # [1, T]
        out = self.model(input_ids=input_ids, use_cache=True)
        return out.logits[0], out.past_key_values  # logits: [T, V]

    def decode_one_token(self, token_id: int, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """Run one new token against the cache; the cache grows by one position per layer."""
        ### BEGIN SOLUTION 1.3
        input_ids = torch.tensor([[token_id]], device=self.device)  # [1, 1]
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return out.logits[0, -1], out.past_key_values  # logits: [V]
        ### END SOLUTION

    # --- the generation loop --------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 trace: RequestTrace | None = None) -> Iterator[RequestOutput]:
        """Prefill, then decode one token per step until EOS, a stop string or ``max_tokens``.

        Yields after every token. Whoever iterates may simply stop (a client went away): the
        generator, and the KV cache it holds, is then dropped before the next decode step.
        """
        self.check_request(prompt_ids, params)
        generator = make_generator(params.seed, self.device)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        output_ids: list[int] = []
        trace = trace or RequestTrace()  # spans, when the server runs with --trace

        with trace.span("prefill"):
            all_logits, cache = self.prefill(prompt_ids)
        logits = all_logits[-1]  # [V]: predicts the first new token
        prompt_logprobs = None  # paid for only when asked: scoring T positions costs T log-softmaxes
        if params.prompt_logprobs is not None:
            prompt_logprobs = compute_logprobs(all_logits[:-1], prompt_ids[1:], params.prompt_logprobs)
        if params.max_tokens == 0:  # only the prompt was to be scored (echo)
            yield RequestOutput(request_id, [], "", "length", len(prompt_ids), 0, [], prompt_logprobs)
            return
        while True:
            token_id = sample(logits, params, generator, output_ids)
            logprobs = None if params.logprobs is None else compute_logprobs(logits[None], [token_id], params.logprobs)
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
            with trace.span("decode"):
                logits, cache = self.decode_one_token(token_id, cache)
