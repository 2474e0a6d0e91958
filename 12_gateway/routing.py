"""Routing by difficulty: ``"model": "auto"`` picks the small model or the large one by a rule cheap enough
to run on every request at the gateway, before any model has seen it.

A large model costs several times a small one per token; most chat turns do not need it. The rule looks at
what the gateway already has: the prompt's length in tokens (it tokenizes to route by prefix anyway), the
tokens the request may generate, and a score of the prompt's words. Long prompts and long answers also
go to the large model's replicas for a second reason: they are the long jobs, and there they do not hold
up the chats on the small model's replicas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Size = Literal["small", "large"]

# Words that ask for reasoning rather than recall or small talk. A real gateway would use a trained
# classifier (RouteLLM's, for instance); a list of markers is the version a reader can check by hand, so every
# form that counts is written out. One marker per idea, with the forms a question uses: a verb's -s, past and -ing
# forms, a noun's plural, the noun a verb makes (proof, derivation, analysis), both spellings. Nothing else: a
# marker is found as whole words, never inside another word. A phrase is found word by word, so "step-by-step"
# and "step by step" are one.
HARD_MARKERS: tuple[tuple[str, ...], ...] = (
    ("prove", "proves", "proved", "proven", "proving", "proof", "proofs"),
    ("derive", "derives", "derived", "deriving", "derivation", "derivations"),
    ("step by step",),
    ("explain why",),
    ("why does",),
    ("analyze", "analyzes", "analyzed", "analyzing", "analyse", "analyses", "analysed", "analysing", "analysis"),
    ("compare", "compares", "compared", "comparing", "comparison", "comparisons"),
    ("trade-off", "trade-offs", "tradeoff", "tradeoffs"),
    ("algorithm", "algorithms"),
    ("complexity",),
    ("debug", "debugs", "debugged", "debugging"),
    ("refactor", "refactors", "refactored", "refactoring"),
    ("optimize", "optimizes", "optimized", "optimizing", "optimise", "optimises", "optimised", "optimising",
     "optimization", "optimisation"),
    ("calculate", "calculates", "calculated", "calculating", "calculation", "calculations"),
)
WORD = re.compile(r"[^\W_]+")  # a run of letters and digits: spaces, punctuation and hyphens end a word


def words(text: str) -> str:
    """The text's words, lower-cased, each between single spaces: " step by step " for "Step-by-step!"."""
    return " " + " ".join(WORD.findall(text.lower())) + " "


MARKER_WORDS = tuple(tuple(words(form) for form in marker) for marker in HARD_MARKERS)


@dataclass(frozen=True)
class DifficultyRule:
    long_prompt_tokens: int = 512
    long_output_tokens: int = 512
    hard_prompt_score: int = 2


@dataclass(frozen=True)
class Route:
    size: Size
    reason: str  # "long_prompt", "long_output", "hard_prompt" or "easy": the label of the gateway's counter


def hardness(text: str) -> int:
    """How many of the markers of reasoning the text holds, each counted once, whichever of its forms and however
    often. Whole words only: "improve" holds no "prove", "waterproof" no "proof"."""
    text_words = words(text)
    return sum(any(form in text_words for form in forms) for forms in MARKER_WORDS)


def choose_size(prompt_tokens: int, max_tokens: int | None, text: str, rule: DifficultyRule) -> Route:
    """Which model an ``auto`` request goes to, and why. The first reason that holds wins, in this order:
    a long prompt, a long answer asked for (``max_tokens`` None says nothing: most chat clients leave it out),
    a hard prompt."""
    ### BEGIN SOLUTION 12.3
    if prompt_tokens >= rule.long_prompt_tokens:
        return Route("large", "long_prompt")
    if max_tokens is not None and max_tokens >= rule.long_output_tokens:
        return Route("large", "long_output")
    if hardness(text) >= rule.hard_prompt_score:
        return Route("large", "hard_prompt")
    return Route("small", "easy")
    ### END SOLUTION
