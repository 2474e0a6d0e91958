"""Stage 02's incremental detokenizer, on the real tokenizer: deltas join up to the full text, a split
character is never emitted half-made, and stop strings are cut even when they span tokens."""

from __future__ import annotations

import pytest

from .conftest import stage

detokenizer = stage("02_streaming", "detokenizer")


@pytest.fixture(scope="module")
def tokenizer(engine02):
    return engine02.tokenizer


def stream(tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], bool]:
    detok = detokenizer.IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        if detok.stopped:
            return deltas, True
    deltas.append(detok.flush())
    return deltas, False


TEXTS = [
    "Plain English, with punctuation: done.",
    "你好，世界！日本の首都は東京です。",
    "Emoji: 🙂🎉👩‍👩‍👧 and a flag 🇫🇷.",
    "    indented code\n\tdef f(x):  return x ** 2\n",
]


@pytest.mark.exercise("2.2")
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_decoded_text_and_never_split_a_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    deltas, stopped = stream(tokenizer, ids, stop=[])
    assert not stopped
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_a_multibyte_character_needs_several_tokens(tokenizer):
    # The premise of the test above: byte-level BPE splits this emoji over more than one token.
    ids = tokenizer("🎉", add_special_tokens=False).input_ids
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])


@pytest.mark.exercise("2.2")
def test_an_unfinished_character_at_the_end_is_dropped(tokenizer):
    ids = tokenizer("ok 🎉", add_special_tokens=False).input_ids[:-1]  # cut inside the emoji
    assert tokenizer.decode(ids) == "ok \ufffd"
    deltas, _ = stream(tokenizer, ids, stop=[])
    assert "".join(deltas) == "ok "


@pytest.mark.exercise("2.2")
def test_stop_string_spanning_tokens_is_cut_and_never_sent(tokenizer):
    text = "The answer is Observation: 42"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    stop = "Observation:"
    # The premise: no single token holds the whole stop string.
    assert all(stop not in tokenizer.decode([i]) for i in ids)
    deltas, stopped = stream(tokenizer, ids, stop=[stop])
    assert stopped
    assert "".join(deltas) == "The answer is "
    assert not any("Obs" in d for d in deltas)


@pytest.mark.exercise("2.2")
def test_held_back_text_is_released_when_the_stop_string_does_not_follow(tokenizer):
    text = "We observed an Observatory."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    deltas, stopped = stream(tokenizer, ids, stop=["Observation:"])
    assert not stopped
    assert "".join(deltas) == text


@pytest.mark.exercise("2.2")
def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer("one two three four", add_special_tokens=False).input_ids
    deltas, stopped = stream(tokenizer, ids, stop=["four", " three"])
    assert stopped and "".join(deltas) == "one two"


@pytest.mark.exercise("2.2")
def test_special_tokens_are_not_text(tokenizer):
    ids = tokenizer("Hi", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    deltas, _ = stream(tokenizer, ids, stop=[])
    assert "".join(deltas) == "Hi"


HELD_BACK = [  # text, characters already sent, stop strings, how many characters to hold back
    ("The answer is Obs", 0, ["Observation:"], 3),
    ("The answer is Obs", 14, ["Observation:"], 3),
    ("The answer is Obs", 17, ["Observation:"], 0),  # sent text is never held back
    ("The answer is ", 0, ["Observation:"], 0),
    ("We observ", 0, ["Observation:"], 0),  # stop strings match case
    ("x Observation", 0, ["Observation:"], 11),
    ("xab", 0, ["b", "abx"], 2),  # the longest possible start wins
    ("Hello", 0, [], 0),
]


@pytest.mark.exercise("2.1")
@pytest.mark.parametrize(("text", "sent", "stop", "held"), HELD_BACK,
                         ids=[f"{text!r}-sent{sent}-{stop}" for text, sent, stop, _ in HELD_BACK])
def test_held_back_is_the_longest_unsent_tail_that_may_start_a_stop_string(tokenizer, text, sent, stop, held):
    detok = detokenizer.IncrementalDetokenizer(tokenizer, stop)
    detok.text, detok.sent = text, sent
    assert detok._held_back() == held
