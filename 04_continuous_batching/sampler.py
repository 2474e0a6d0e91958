"""Sampling, batched: turn each sequence's logits for its next position into one token id.

Every request of a batch brings its own parameters. Greedy rows (temperature 0) take the argmax.
The others are divided by their temperature, cut down to their ``top_k`` best tokens and to the
smallest set whose probability reaches their ``top_p``, all rows at once; then each row draws one
token with noise from *its own* random stream, so a seeded request gives the same text whatever
else shares its batch.
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


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Per row, keep exactly the ``top_k`` highest logits (0 keeps all); every other token gets -inf."""
    # logits: [B, V]; top_k: [B] int64
    vocab = logits.shape[-1]
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    # Rank, not a `logits < kth value` threshold, so that ties at the k-th value keep exactly k tokens.
    drop_sorted = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, keep the smallest set of most likely tokens whose total probability reaches ``top_p``."""
    # logits: [B, V]; top_p: [B] float
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the best always stays.
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False  # explicitly: rounding can leave the first mass_before a hair above 0
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def logits_to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distributions that sampling draws from: temperature, then top-k, then top-p, row by row."""
    # logits: [B, V] -> probs: [B, V]
    assert all(p.temperature > 0 for p in params), "greedy requests never build a distribution"
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits.float() / temperature[:, None]
    if any(p.top_k > 0 for p in params):
        # Clamped to the vocabulary first: any larger k means "keep all", and may not fit in int64.
        vocab = logits.shape[-1]
        logits = apply_top_k(logits, torch.tensor([min(p.top_k, vocab) for p in params], device=device))
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One token id per row of ``logits``, each row by its own parameters and random stream."""
    # logits: [B, V] -> B token ids
    tokens = torch.argmax(logits, dim=-1)  # [B]: the answer for greedy rows
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        probs = logits_to_probs(logits[drawn], [params[i] for i in drawn])  # [b, V]
        # The exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
        # Each row's noise comes from its request's own generator, so no row affects another.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[i]) for i in drawn])
        tokens[drawn] = torch.argmax(probs / noise, dim=-1)
    return tokens.tolist()
