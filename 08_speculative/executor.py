"""The executor: the engine's side of one step, in two calls. ``launch`` runs the step without reading anything back;
``InFlight.read`` is the one wait, for the step's tokens.

    batch   = scheduler.schedule()        # who runs, and how many tokens each
    flight  = executor.launch(batch)      # propose, prepare, run the model
    sampled = flight.read()               # the one wait: verify (or sample) on the host, the step's runs
    outputs = scheduler.postprocess(batch, sampled)

On a GPU the forward pass is queued on the stream, and ``launch`` returns while it runs: ``read`` is the first call
that needs its numbers, and waits there. On a CPU the pass has run when ``launch`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.trace import StepClock

from .model_runner import ModelRunner
from .proposer import DraftProposer, NgramProposer
from .sampler import TokenLogprobs, compute_logprobs
from .scheduler import Batch, Sampled, Scheduler
from .sequence import Sequence, StepKind
from .speculative import verify


@dataclass
class InFlight:
    """A launched step: what it ran, and its forward pass's output, unread. Each field is the step's own, taken at
    launch: the scheduler counts the step as run (and clears the sequences' guesses) before it is read."""

    batch: Batch
    sampling: list[Sequence]  # the sequences it samples for, in the order of its rows of logits
    guesses: list[list[int]]  # each sampling sequence's guesses (verification)
    guess_probs: list[torch.Tensor | None]  # and what a draft model drew them from
    reserved: list[int]  # each sampling sequence's room reserved for guesses
    kinds: list[StepKind]  # what the step did for each sequence of the batch
    num_tokens: int  # tokens its forward pass ran
    prompt_starts: list[int]  # each sequence's first position in the step: its first scored row predicts the next
    num_prompt_logits: list[int]  # each sequence's prompt rows scored (echo; 0: none)
    logits: torch.Tensor | None  # [R, V]: 1 + k rows per sampling sequence
    prompt_logits: torch.Tensor | None  # [M, V]: the prompt rows that score their prompt

    def read(self, clock: StepClock | None = None) -> list[Sampled]:
        """The step's news for each sequence of its batch, in order: the one wait for the device."""
        clock = clock or StepClock()
        runs, logprobs = self._verify()
        chosen = {id(seq): (run, lp, len(guesses), room) for seq, run, lp, guesses, room
                  in zip(self.sampling, runs, logprobs, self.guesses, self.reserved, strict=True)}
        scored = self.prompt_logits.split(self.num_prompt_logits) if self.prompt_logits is not None else None
        news = []
        for i, seq in enumerate(self.batch.seqs):
            prompt_logprobs = None
            if scored is not None and self.num_prompt_logits[i]:
                prompt_logprobs = score_prompt(seq, self.prompt_starts[i], scored[i])
            run, run_logprobs, proposed, room = chosen.get(id(seq), ([], [], 0, 0))
            news.append(Sampled(run, run_logprobs, prompt_logprobs, proposed, room))
        clock.lap("verify")
        return news

    def _verify(self) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """The run of every sampling sequence: the longest run of its guesses the model agrees with, plus one token of
        its own, from its 1 + k rows of ``logits``; with the logprobs its request asked for."""
        if not self.sampling:
            return [], []
        assert self.logits is not None
        runs = verify(self.logits, [seq.params for seq in self.sampling], self.guesses, self.guess_probs,
                      [seq.output_ids for seq in self.sampling], [seq.generator for seq in self.sampling])
        return runs, self._run_logprobs(runs)

    def _run_logprobs(self, runs: list[list[int]]) -> list[list[TokenLogprobs | None]]:
        """Each sampling sequence's logprobs of the tokens of its run (None where it did not ask): row i of a
        sequence scores its run's token i; the rows of rejected guesses score nothing."""
        assert self.logits is not None
        targets, ks = [], []
        for seq, guesses, run in zip(self.sampling, self.guesses, runs, strict=True):
            targets += run + guesses[len(run):]  # past the run: any valid id, its row is not asked for
            ks += [seq.params.logprobs] * len(run) + [None] * (1 + len(guesses) - len(run))
        measured = compute_logprobs(self.logits, targets, ks)
        per_seq, start = [], 0
        for guesses, run in zip(self.guesses, runs, strict=True):
            per_seq.append(measured[start : start + len(run)])
            start += 1 + len(guesses)
        return per_seq


def score_prompt(seq: Sequence, start: int, logits: torch.Tensor) -> list[TokenLogprobs]:
    """Echo: the logprobs of the prompt tokens that ``seq``'s rows of a step predict; its first row is at position
    ``start`` and predicts the token after it."""
    # logits: [m, V] for positions start .. start + m - 1, which predict prompt tokens start + 1 .. start + m
    targets = seq.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    return compute_logprobs(logits, targets, [seq.params.prompt_logprobs] * len(targets))


class Executor:
    """The engine's side of a step: the proposer and the model runner."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler,
                 proposer: NgramProposer | DraftProposer | None) -> None:
        self.runner = runner
        self.scheduler = scheduler  # it alone writes a sequence: the proposer's guesses go through it
        self.proposer = proposer

    def launch(self, batch: Batch, clock: StepClock) -> InFlight:
        """Propose (a step with room for guesses), prepare and run the model."""
        kinds: list[StepKind] = ["decode" if seq.output_ids and seq.num_new_tokens == 1 else "prefill"
                                 for seq in batch.seqs]
        num_tokens, prompt_starts = batch.num_tokens, [seq.num_computed_tokens for seq in batch.seqs]
        self._propose(batch)
        clock.lap("propose")
        inputs = self.runner.prepare(batch)
        clock.lap("prepare")
        logits, prompt_logits = self.runner.execute(inputs)  # [R, V]: 1 + k rows per sampling sequence; [M, V]
        clock.lap("execute")
        sampling = [seq for seq in batch.seqs if seq.samples_next_token]  # [S]; none when only mid-prompt chunks
        return InFlight(batch, sampling, [seq.draft_ids for seq in sampling], [seq.draft_probs for seq in sampling],
                        [seq.num_lookahead_slots for seq in sampling], kinds, num_tokens, prompt_starts,
                        list(inputs.num_prompt_logits), logits, prompt_logits)

    def _propose(self, batch: Batch) -> None:
        """The sequences the scheduler reserved room for get up to that many guesses each."""
        seqs = [seq for seq in batch.seqs if seq.num_lookahead_slots]
        if not seqs:
            return
        assert self.proposer is not None, "room for guesses, and nobody to guess"
        self.scheduler.set_guesses(seqs, self.proposer.propose(seqs, [seq.num_lookahead_slots for seq in seqs]))
