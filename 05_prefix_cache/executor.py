"""The executor: the engine's side of one step, in two calls. ``launch`` runs the step without reading anything back;
``InFlight.read`` is the one wait, for the step's tokens.

    batch   = scheduler.schedule()        # who runs
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
from .sampler import compute_logprobs, sample
from .scheduler import Batch, Sampled


@dataclass
class InFlight:
    """A launched step: what it ran, and its forward pass's output, unread."""

    batch: Batch
    num_prompt_logits: list[int]  # each sequence's prompt rows scored (echo; 0: none)
    logits: torch.Tensor  # [B, V]: a row per sequence
    prompt_logits: torch.Tensor | None  # [M, V]: the prompt rows that score their prompt

    def read(self, clock: StepClock | None = None) -> list[Sampled]:
        """Every sequence's next token, from its row of ``logits``, with the logprobs its request asked for: the one
        wait for the device."""
        clock = clock or StepClock()
        seqs = self.batch.seqs
        params = [seq.params for seq in seqs]
        token_ids = sample(self.logits, params, [seq.generator for seq in seqs], [seq.output_ids for seq in seqs])
        logprobs = compute_logprobs(self.logits, token_ids, [p.logprobs for p in params])  # None for rows not asking
        scored = self.prompt_logits.split(self.num_prompt_logits) if self.prompt_logits is not None else None
        news = []
        for i, seq in enumerate(seqs):
            prompt_logprobs = None
            if scored is not None and self.num_prompt_logits[i]:  # echo: the prompt's own logprobs
                ks = [seq.params.prompt_logprobs] * self.num_prompt_logits[i]
                prompt_logprobs = compute_logprobs(scored[i], seq.prompt_ids[1:], ks)
            news.append(Sampled([token_ids[i]], [logprobs[i]], prompt_logprobs))
        clock.lap("sample")
        return news


class Executor:
    """The engine's side of a step: the model runner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def launch(self, batch: Batch, clock: StepClock) -> InFlight:
        """Prepare and run the model."""
        inputs = self.runner.prepare(batch)
        clock.lap("prepare")
        logits, prompt_logits = self.runner.execute(inputs)  # [B, V], and [M, V] for prompts to score
        clock.lap("execute")
        return InFlight(batch, list(inputs.num_prompt_logits), logits, prompt_logits)
