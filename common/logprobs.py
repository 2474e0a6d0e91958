"""OpenAI's two logprobs shapes, written from what the engine measured.

The engine reports, for each token it was asked about, a ``TokenLogprobs`` of its stage's sampler:
the token id, its logprob and the k best alternatives as (token id, logprob). Here those become

* the completions shape: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of
  token string -> logprob: the k best plus the chosen token, as OpenAI returns them) and
  ``text_offset`` (where each token's text starts in the choice's ``text``);
* the chat shape: ``content``, a list of ``{token, logprob, bytes, top_logprobs: [...]}``.

A token's string is the text its step released, so the strings always join to the returned text.
That is not always the token's own text: a step whose text is held back (half of a multi-byte
character, or what may be the start of a stop string) releases "", and the step that completes it
releases both; the last token before a stop string releases only what comes before the stop. The
alternatives are decoded one by one, since none of them was ever part of the text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class MeasuredLogprobs(Protocol):
    """What each stage's sampler measures at one position (its ``TokenLogprobs``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class LogprobEntry:
    """One token of the answer, ready to format: its released text and its numbers."""

    text: str  # the text this token released; the entries' texts join to the output text
    token: str  # the token decoded on its own (what top_logprobs calls it)
    logprob: float | None  # None only for a prompt's first token
    top: list[tuple[str, float]]  # the k best alternatives, decoded, best first


def entries(measured: Sequence[MeasuredLogprobs], texts: Sequence[str],
            decode: Callable[[int], str]) -> list[LogprobEntry]:
    """Pair each measured position with the text its token released."""
    assert len(measured) == len(texts), f"{len(measured)} logprobs for {len(texts)} token texts"
    return [
        LogprobEntry(text, decode(m.token_id), m.logprob, [(decode(t), lp) for t, lp in m.top])
        for m, text in zip(measured, texts, strict=True)
    ]


@dataclass
class Echo:
    """The prompt, for ``echo``: its token ids and the text each of them released when detokenized."""

    token_ids: list[int]
    texts: list[str]


class AnswerWriter:
    """Turns a request's outputs, a group at a time (one streamed chunk, or the whole answer), into its
    text and, if asked, its logprobs in either API's shape.

    With ``echo``, the prompt comes first, in the first group, with the prompt's logprobs if the engine
    measured them (its first token has none: nothing came before it to predict it). Outputs are the
    stage's ``RequestOutput``s: ``token_ids``, ``text``, ``logprobs`` and, in the first, ``prompt_logprobs``.
    """

    def __init__(self, decode: Callable[[int], str], with_logprobs: bool, echo: Echo | None = None) -> None:
        self.decode = decode
        self.with_logprobs = with_logprobs
        self.echo = echo
        self.offset = 0  # characters of text in earlier groups: text_offset goes on from here

    def _take(self, outputs: Sequence[Any]) -> tuple[str, list[LogprobEntry]]:
        texts: list[str] = []
        items: list[LogprobEntry] = []
        if self.echo is not None and outputs:
            echo, self.echo = self.echo, None
            texts += echo.texts
            if self.with_logprobs:
                items.append(LogprobEntry(echo.texts[0], self.decode(echo.token_ids[0]), None, []))
                items += entries(outputs[0].prompt_logprobs, echo.texts[1:], self.decode)
        for output in outputs:
            texts.append(output.text)
            if self.with_logprobs and output.token_ids:
                # A step's text goes to its last token (every step adds one token until stage 08).
                token_texts = [""] * (len(output.token_ids) - 1) + [output.text]
                items += entries(output.logprobs, token_texts, self.decode)
        return "".join(texts), items

    def completion(self, outputs: Sequence[Any]) -> tuple[str, CompletionLogprobs | None]:
        """The completions shape: parallel lists; ``top_logprobs`` has the k best and the chosen token."""
        text, items = self._take(outputs)
        if not self.with_logprobs:
            return text, None
        out = CompletionLogprobs()
        for item in items:
            out.tokens.append(item.text)
            out.token_logprobs.append(item.logprob)
            if item.logprob is None:
                out.top_logprobs.append(None)
            else:  # OpenAI's rule: the k best, and the chosen token even when it is not among them
                out.top_logprobs.append({**dict(item.top), item.token: item.logprob})
            out.text_offset.append(self.offset)
            self.offset += len(item.text)
        return text, out

    def chat(self, outputs: Sequence[Any]) -> tuple[str, ChatLogprobs | None]:
        """The chat shape: one entry per output token, with its UTF-8 bytes and its k best alternatives."""
        text, items = self._take(outputs)
        if not self.with_logprobs:
            return text, None

        def top(token: str, logprob: float) -> TopLogprob:
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return text, ChatLogprobs(content=[
            ChatTokenLogprob(token=item.text, logprob=item.logprob, bytes=list(item.text.encode()),
                             top_logprobs=[top(token, logprob) for token, logprob in item.top])
            for item in items
        ])
