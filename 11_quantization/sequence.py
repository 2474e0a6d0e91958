"""Request state. ``Sequence`` is what the engine core knows about one request; ``Request`` is
what the HTTP side holds while it waits for that request's tokens; ``RequestOutput`` goes between,
and ``StepResult`` is what one turn of the engine produced."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Literal

import torch

from common.trace import RequestTrace

from .detokenizer import IncrementalDetokenizer
from .sampler import SamplingParams, TokenLogprobs
from .speculative import Speculation

if TYPE_CHECKING:
    from .proposer import NgramIndex

# Why a sequence ended: EOS or a stop string, max_tokens, or a failure (the output then carries the error).
FinishReason = Literal["stop", "length", "error"]
# What a step did for one sequence (its trace's span): computed a prompt, or one new token.
StepKind = Literal["prefill", "decode"]


@dataclass
class RequestOutput:
    """One step's news for the client: the tokens it emitted (1 to k + 1), the text they made safe to send."""

    request_id: str
    token_ids: list[int]  # the tokens this step added: 1 to k + 1 (none for a prompt scored with max_tokens 0)
    text: str  # "" from the core; the API process's detokenizer fills it (still "" while a character is incomplete)
    finish_reason: FinishReason | None  # None while running
    prompt_tokens: int
    completion_tokens: int  # tokens generated so far, this one included
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, if the request asked
    # In the first output only, if the request asked: prompt tokens 1... (the first has no logprob).
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: Exception | None = None  # why the request failed, with finish_reason "error"
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (usage.prompt_tokens_details)
    index: int = 0  # which of the request's n samples (its choice's index)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(cls, request_id: str, error: Exception, prompt_tokens: int, completion_tokens: int = 0,
               index: int = 0) -> RequestOutput:
        """The last output of a request (or of its sample ``index``) that failed: the server turns ``error`` into
        an HTTP status."""
        return cls(request_id, [], "", "error", prompt_tokens, completion_tokens, error=error, index=index)


@dataclass(frozen=True)
class StepResult:
    """What one turn of the engine produced: an output for every sequence with news from the step it read, and the
    size of the step it launched (overlapping, the two are different steps: N read, N + 1 launched)."""

    outputs: list[RequestOutput]
    num_tokens: int = 0  # tokens the forward pass ran (0: nothing was scheduled)
    num_decoding: int = 0  # sequences that decoded: each waited for this step between two of its tokens
    accepted_lengths: list[int] = field(default_factory=list)  # each verification's: the guesses it kept
    # The step whose tokens this turn read (from stage 10 on, the one launched a turn before): the device's time for it
    # (CUDA events, or the device thread's clock: never the host's launch), and the sequences that decoded in it.
    device_seconds: float = 0.0
    device_decoding: int = 0


class SequenceStatus(Enum):
    WAITING = "waiting"  # in the scheduler's queue: new, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds blocks; decoded at every step
    FINISHED = "finished"  # done, failed, or dropped because its client left; holds nothing


@dataclass
class Sequence:
    """One request inside the engine: its tokens, its blocks, and how to sample it. The
    scheduler alone changes it (admits, appends, finishes, frees); the other components only read it, but
    for the proposers: the draft proposer counts the draft model's progress in its own cache, the n-gram
    proposer keeps the index of its n-grams."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator  # this request's own random stream (seeded or not)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (back to 0 when preempted)
    num_scheduled_tokens: int = 0  # tokens the step being run adds to the cache: a chunk, or 1 + its guesses (decode)
    num_cached_tokens: int = 0  # prompt tokens it found in the prefix cache when first admitted
    status: SequenceStatus = SequenceStatus.WAITING
    trace: RequestTrace = field(default_factory=RequestTrace)  # spans, when the server runs with --trace
    index: int = 0  # which of its request's n samples this is
    forks: list[Sequence] = field(default_factory=list)  # the other samples, started once this one is prefilled
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # echo: scored chunk by chunk, sent at the end
    # Speculative decoding: the room and the guesses of the step being run.
    speculation: Speculation = field(default_factory=lambda: Speculation(0))  # its k, its acceptance rate
    num_lookahead_slots: int = 0  # this step: room the scheduler reserved for guesses (the proposer may use fewer)
    draft_ids: list[int] = field(default_factory=list)  # this step's guesses, checked after the last token
    draft_probs: torch.Tensor | None = None  # [len(draft_ids), V]: what a sampling draft model drew them from
    num_draft_computed_tokens: int = 0  # tokens whose K/V are in the draft model's cache (a draft proposer only)
    ngram_index: NgramIndex | None = None  # where each of its n-grams last ended (the n-gram proposer's, made lazily)
    # Overlap scheduling: tokens sampled by launched steps that the host has not read yet, oldest first. Each is
    # known by its row in its step's sampled tokens (on the device); the step after reads it from there.
    pending_rows: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output joined: a new list of every token, so not for each step (see ``tokens``)."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """``token_ids[start:stop]`` without joining the two lists: a step's cost must not grow with the
        sequence's length, and a decode step needs one token of it. A position past the known tokens (a token
        still on the device) reads as its placeholder (``placeholder``)."""
        prompt, known = self.prompt_ids, len(self.prompt_ids) + len(self.output_ids)
        ids = prompt[start:stop] + self.output_ids[max(0, start - len(prompt)) : max(0, stop - len(prompt))]
        return ids + [placeholder(row) for row in self.pending_rows[max(0, start - known) : max(0, stop - known)]]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its first prefill must score the prompt (a recomputation after preemption has, already)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output, the tokens still on the device included. While running, the cache holds all but
        the last: the next step runs it."""
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending_rows)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, those still on the device included: what ``max_tokens`` counts."""
        return len(self.output_ids) + len(self.pending_rows)

    @property
    def num_new_tokens(self) -> int:
        """Tokens not in the cache yet: the rest of its prompt (after cached blocks and earlier chunks) while it is
        prefilled, one while it decodes."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def samples_next_token(self) -> bool:
        """Whether the step being run reaches its last token (and its guesses), whose logits sample the next
        tokens. False for a chunk that ends part-way through the prompt: that step produces nothing for it."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens + len(self.draft_ids)


def placeholder(row: int) -> int:
    """The input id that stands for a token not yet read from the device: the token in ``row`` of the sampled
    tokens of the step in flight, -1 - row (a real id is never negative). The model runner swaps it for the
    token itself on the device (``resolve_placeholders``)."""
    return -1 - row


@dataclass
class Request:
    """The HTTP side's handle: where the core's news delivers this request's outputs (or an error)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    arrival_time: float = field(default_factory=time.perf_counter)
    last_token_time: float = 0.0
    finished: bool = False
    trace: RequestTrace = field(default_factory=RequestTrace)
    n: int = 1  # samples of the prompt: the request ends when all n have finished
    num_finished: int = 0  # samples that have
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)  # one per sample: its text, its stops
