"""Driving a scheduler the way its engine does, without a model: ``schedule``, then ``launched`` and ``postprocess``
with a token for every sequence whose step reaches its last one (``finish_step``). Up to stage 09 the sequences need a
detokenizer; these tests count tokens, not words."""

from __future__ import annotations

import inspect
from typing import Any

from .stages import has


class SilentDetokenizer:
    """What the scheduler asks of a detokenizer, with no text."""

    stopped = False

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def no_text(folder: str) -> dict[str, Any]:
    """A ``Sequence``'s detokenizer argument in ``folder``: a silent one, or none from stage 10 on, where the text is
    the API process's and a sequence has no detokenizer."""
    return {} if has(folder, "overlap") else {"detokenizer": SilentDetokenizer()}


def reaches_its_last_token(seq: Any) -> bool:
    """Whether the step just scheduled samples for ``seq`` (a mid-prompt chunk does not; before chunking, every
    scheduled sequence does)."""
    return getattr(seq, "samples_next_token", True)


def run(scheduler: Any, scheduler_module: Any, batch: Any, token_id: int = 0) -> list[str]:
    """What the engine does after the forward pass: ``finish_step`` with ``token_id`` for every sequence whose step
    reaches its last token. Returns who sampled."""
    sampling = [seq for seq in batch.seqs if reaches_its_last_token(seq)]
    sampled = [scheduler_module.Sampled([token_id], [None]) if seq in sampling else scheduler_module.Sampled([], [])
               for seq in batch.seqs]
    finish_step(scheduler, batch, sampled)
    return [seq.request_id for seq in sampling]


def finish_step(scheduler: Any, batch: Any, sampled: list[Any]) -> None:
    """The step has run and ``sampled[i]`` is what it chose for ``batch.seqs[i]``: the engine's two calls, ``launched``
    (its tokens count as computed; from stage 10 on, each sequence that samples gets a pending token), then
    ``postprocess`` with what was read, each run carrying (from stage 08 on) the guesses it checked and the room it had:
    the step's own record, since ``launched`` clears them from the sequence."""
    sampling = [seq for seq in batch.seqs if reaches_its_last_token(seq)]
    if sampled and hasattr(sampled[0], "proposed"):
        sampled = [type(news)(news.token_ids, news.logprobs, news.prompt_logprobs, len(seq.draft_ids),
                              seq.num_lookahead_slots) if news.token_ids else news
                   for seq, news in zip(batch.seqs, sampled, strict=True)]
    if "sampling" in inspect.signature(scheduler.launched).parameters:
        scheduler.launched(batch, sampling)
    else:
        scheduler.launched(batch)
    scheduler.postprocess(batch, sampled)
