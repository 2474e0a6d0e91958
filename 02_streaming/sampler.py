"""Sampling: turn the model's logits for the next position into one token id.

Greedy decoding (temperature 0) takes the argmax. Otherwise the logits are divided by the
temperature, cut down to the ``top_k`` best tokens and to the smallest set whose probability
reaches ``top_p``, and one token is drawn from what is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this, sampling is greedy: logits divided by a smaller temperature overflow float32
# (and 1e-300 itself rounds to 0 in float32), while the distribution is already one-hot.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """What a request asks of generation; the server has validated the ranges."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) means greedy
    top_k: int = 0  # 0 (or -1) keeps every token
    top_p: float = 1.0  # 1.0 keeps every token
    seed: int | None = None  # the same seed gives the same text
    stop: list[str] = field(default_factory=list)  # generation ends before any of these strings
    ignore_eos: bool = False  # benchmarks generate exactly max_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private random stream per request, so a seeded request does not depend on any other."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # fresh, non-deterministic
    else:
        generator.manual_seed(seed)
    return generator


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep exactly the ``top_k`` highest logits; every other token gets -inf."""
    # logits: [V]
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    best = torch.topk(logits, top_k)
    # Scatter (not a `logits < kth` threshold) so that ties at the k-th value keep exactly k tokens.
    return torch.full_like(logits, float("-inf")).scatter(-1, best.indices, best.values)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose total probability is at least ``top_p``."""
    # logits: [V]
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the best always stays.
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[0] = False  # explicitly: rounding can leave the first mass_before a hair above 0
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution that sampling draws from: temperature, then top-k, then top-p."""
    # logits: [V] -> probs: [V]
    assert params.temperature > 0, "greedy requests never build a distribution"
    logits = logits.float() / params.temperature
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token id from the logits of one position."""
    # logits: [V]
    if params.greedy:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, params)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))
