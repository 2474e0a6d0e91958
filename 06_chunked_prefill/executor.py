"""The executor: the engine's side of one step, in two calls. ``launch`` runs the step without reading anything back;
``InFlight.read`` is the one wait, for the step's tokens.

    batch   = scheduler.schedule()        # who runs, and how many tokens each
    flight  = executor.launch(batch)      # prepare, run the model
    sampled = flight.read()               # the one wait: sample on the logits, the tokens on the host
    outputs = scheduler.postprocess(batch, sampled)

On a GPU the forward pass is queued on the stream, and ``launch`` returns while it runs: ``read`` is the first call
that needs its numbers, and waits there. On a CPU the pass has run when ``launch`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.trace import StepClock

from .model_runner import ModelRunner
from .sampler import TokenLogprobs, compute_logprobs, sample
from .scheduler import Batch, Sampled
from .sequence import Sequence, StepKind


@dataclass
class InFlight:
    """A launched step: what it ran, and its forward pass's output, unread. Each field is the step's own, taken at
    launch: the scheduler counts the step as run before it is read."""

    batch: Batch
    sampling: list[Sequence]  # the sequences it samples for, in the order of its rows of logits
    kinds: list[StepKind]  # what the step did for each sequence of the batch
    num_tokens: int  # tokens its forward pass ran
    prompt_starts: list[int]  # each sequence's first position in the step: its first scored row predicts the next
    num_prompt_logits: list[int]  # each sequence's prompt rows scored (echo; 0: none)
    logits: torch.Tensor | None  # [S, V]: a row per sampling sequence
    prompt_logits: torch.Tensor | None  # [M, V]: the prompt rows that score their prompt

    def read(self, clock: StepClock | None = None) -> list[Sampled]:
        """The step's news for each sequence of its batch, in order: the one wait for the device."""
        clock = clock or StepClock()
        runs, logprobs = self._sample()
        chosen = {id(seq): (run, lp) for seq, run, lp in zip(self.sampling, runs, logprobs, strict=True)}
        scored = self.prompt_logits.split(self.num_prompt_logits) if self.prompt_logits is not None else None
        news = []
        for i, seq in enumerate(self.batch.seqs):
            prompt_logprobs = None
            if scored is not None and self.num_prompt_logits[i]:
                prompt_logprobs = score_prompt(seq, self.prompt_starts[i], scored[i])
            run, run_logprobs = chosen.get(id(seq), ([], []))
            news.append(Sampled(run, run_logprobs, prompt_logprobs))
        clock.lap("sample")
        return news

    def _sample(self) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """The next token of every sampling sequence, from its row of ``logits``, with the logprobs its request asked
        for (a chunk that ends part-way through its prompt samples nothing)."""
        if not self.sampling:
            return [], []
        assert self.logits is not None
        params = [seq.params for seq in self.sampling]
        token_ids = sample(self.logits, params, [seq.generator for seq in self.sampling],
                           [seq.output_ids for seq in self.sampling])
        logprobs = compute_logprobs(self.logits, token_ids, [p.logprobs for p in params])  # None: not asked
        return [[token] for token in token_ids], [[lp] for lp in logprobs]


def score_prompt(seq: Sequence, start: int, logits: torch.Tensor) -> list[TokenLogprobs]:
    """Echo: the logprobs of the prompt tokens that ``seq``'s rows of a step predict; its first row is at position
    ``start`` and predicts the token after it."""
    # logits: [m, V] for positions start .. start + m - 1, which predict prompt tokens start + 1 .. start + m
    targets = seq.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    return compute_logprobs(logits, targets, [seq.params.prompt_logprobs] * len(targets))


class Executor:
    """The engine's side of a step: the model runner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def launch(self, batch: Batch, clock: StepClock) -> InFlight:
        """Prepare and run the model."""
        kinds: list[StepKind] = ["decode" if seq.output_ids and seq.num_new_tokens == 1 else "prefill"
                                 for seq in batch.seqs]
        num_tokens, prompt_starts = batch.num_tokens, [seq.num_computed_tokens for seq in batch.seqs]
        inputs = self.runner.prepare(batch)
        clock.lap("prepare")
        logits, prompt_logits = self.runner.execute(inputs)  # [S, V] for the S that sample; [M, V] to score prompts
        clock.lap("execute")
        sampling = [seq for seq in batch.seqs if seq.samples_next_token]  # [S]; none when only mid-prompt chunks
        return InFlight(batch, sampling, kinds, num_tokens, prompt_starts, list(inputs.num_prompt_logits), logits,
                        prompt_logits)
