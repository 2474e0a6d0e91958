"""Incremental detokenization: token ids in, text deltas out, safe to send the moment they appear.

Two things make this harder than ``tokenizer.decode(ids)``:

* A token is not a character. Byte-level tokenizers split one emoji or CJK character across
  several tokens, and decoding only some of them yields U+FFFD. We wait until the character is
  whole.
* A stop string may span tokens. If the text so far ends with ``"Obs"`` and the stop string is
  ``"Observation:"``, those three characters may be the start of it, so we hold them back until
  the next tokens decide. Text that becomes part of a stop string is never sent.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what decode() returns for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        # ids[prefix_offset:read_offset] is already-decoded context. Decoding a window that starts
        # a little before the new tokens keeps word-joining spaces right (sentencepiece drops a
        # leading space when a sequence starts mid-word).
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # the output so far, whole characters only, cut at a stop string if one hit
        self.sent = 0  # len(text) already handed out
        self.stopped = False  # a stop string was found; text ends right before it

    def add(self, token_id: int) -> str:
        """Add one token; return the new text that is safe to send (often "", never broken)."""
        assert not self.stopped, "no tokens after a stop string"
        self.ids.append(token_id)
        self.text += self._decode_new()
        if self._cut_at_stop():
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def flush(self) -> str:
        """Generation is over: send what is left. No more tokens can complete a held-back stop string,
        and a character still missing bytes never will be whole, so it is dropped."""
        if not self.stopped:
            self.text += self._decode_new(final=True)
            self._cut_at_stop()
        return self._take(len(self.text))

    def _decode_new(self, final: bool = False) -> str:
        ### BEGIN SOLUTION 2.2
        context = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        window = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if final:
            window = window.rstrip(REPLACEMENT_CHAR)
        elif window.endswith(REPLACEMENT_CHAR):
            return ""  # a character still waits for its next bytes
        if len(window) <= len(context):
            return ""  # nothing new yet (a special token, or bytes of an unfinished character)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window[len(context) :]
        ### END SOLUTION

    def _cut_at_stop(self) -> bool:
        """Cut ``text`` before the earliest stop string; what was sent cannot hold one (see _held_back)."""
        hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) != -1]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest unsent tail of ``text`` that could be the start of a stop string."""
        ### BEGIN SOLUTION 2.1
        unsent = self.text[self.sent :]
        longest = max((len(s) for s in self.stop), default=0)
        for n in range(min(len(unsent), longest), 0, -1):
            if any(s.startswith(unsent[-n:]) for s in self.stop):
                return n
        return 0
        ### END SOLUTION

    def _take(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta
