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
# classifier (RouteLLM's, for instance); a list of markers is the version a reader can check by hand.
HARD_MARKERS = ("prove", "proof", "derive", "step by step", "explain why", "why does", "analyze", "analyse",
                "compare", "trade-off", "algorithm", "complexity", "debug", "refactor", "optimize", "calculate")
MARKER = re.compile("|".join(re.escape(marker) for marker in HARD_MARKERS))


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
    """How many of the markers of reasoning the text holds, each counted once."""
    return len(set(MARKER.findall(text.lower())))


def choose_size(prompt_tokens: int, max_tokens: int | None, text: str, rule: DifficultyRule) -> Route:
    """Which model an ``auto`` request goes to, and why. The first reason that holds wins, in this order:
    a long prompt, a long answer asked for (``max_tokens`` None says nothing: most chat clients leave it out),
    a hard prompt."""
    ### BEGIN SOLUTION 10.3
    if prompt_tokens >= rule.long_prompt_tokens:
        return Route("large", "long_prompt")
    if max_tokens is not None and max_tokens >= rule.long_output_tokens:
        return Route("large", "long_output")
    if hardness(text) >= rule.hard_prompt_score:
        return Route("large", "hard_prompt")
    return Route("small", "easy")
    ### END SOLUTION
