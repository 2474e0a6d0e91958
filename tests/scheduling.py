"""Driving a scheduler the way its engine does, without a model: ``schedule``, then ``update`` with a token for
every sequence whose step reaches its last one. Up to stage 09 the sequences need a detokenizer; these tests count
tokens, not words."""

from __future__ import annotations

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
    """What the engine does after the forward pass: ``update`` with ``token_id`` for every sequence whose step
    reaches its last token. Returns who sampled."""
    sampling = [seq for seq in batch.seqs if reaches_its_last_token(seq)]
    sampled = [scheduler_module.Sampled([token_id], [None]) if seq in sampling else scheduler_module.Sampled([], [])
               for seq in batch.seqs]
    scheduler.update(batch, sampled)
    return [seq.request_id for seq in sampling]
