"""Sampling: turn the model's logits for the next position into one token id, and say how likely it was.

First the request's penalties and ``logit_bias`` adjust the logits (OpenAI's definitions). Greedy
decoding (temperature 0) then takes the argmax. Otherwise the logits are divided by the
temperature, cut down to the ``top_k`` best tokens and to the smallest set whose probability
reaches ``top_p``, and one token is drawn from what is left.

A *logprob* is the log-probability the model itself gave a token: the log-softmax of the raw
logits, before penalties, temperature, top-k and top-p (vLLM's convention), in float32. It is what
evaluation harnesses score and what ``logprobs`` returns, and it does not depend on how we sample.
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
    presence_penalty: float = 0.0  # subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # report each output token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (max_tokens may then be 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass
class TokenLogprobs:
    """One position: the chosen token's logprob and the k most likely tokens, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), k of them


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private random stream per request, so a seeded request does not depend on any other."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # fresh, non-deterministic
    else:
        generator.manual_seed(seed)
    return generator


def apply_penalties(logits: torch.Tensor, output_ids: list[int], params: SamplingParams) -> torch.Tensor:
    """OpenAI's penalties over the tokens generated so far, then ``logit_bias``; before temperature.

    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0), then += bias[t].
    """
    # logits: [V]
    if not params.penalized:
        return logits
    logits = logits.float()
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output_ids, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[-1]).float()  # [V]: times each token was generated
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
        logits = logits.index_add(-1, ids, bias)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep exactly the ``top_k`` highest logits; every other token gets -inf."""
    # logits: [V]
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    ### BEGIN SOLUTION 1.1
    best = torch.topk(logits, top_k)
    # Scatter (not a `logits < kth` threshold) so that ties at the k-th value keep exactly k tokens.
    return torch.full_like(logits, float("-inf")).scatter(-1, best.indices, best.values)
    ### END SOLUTION


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose total probability is at least ``top_p``."""
    # logits: [V]
    if top_p >= 1.0:
        return logits
    ### BEGIN SOLUTION 1.2
    sorted_logits, order = torch.sort(logits, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the best always stays.
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[0] = False  # explicitly: rounding can leave the first mass_before a hair above 0
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
    ### END SOLUTION


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution that sampling draws from: temperature, then top-k, then top-p."""
    # logits: [V] -> probs: [V]
    assert params.temperature > 0, "greedy requests never build a distribution"
    logits = logits.float() / params.temperature
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           output_ids: list[int] | None = None) -> int:
    """Pick the next token id from the logits of one position (``output_ids``: generated so far)."""
    # logits: [V]
    logits = apply_penalties(logits, output_ids or [], params)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, params)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """For each row: the logprob of ``token_ids[row]`` and the ``k`` most likely tokens, best first.

    The rows are positions: one (the token just sampled), or every prompt position at once (row i
    holds the logits that predicted prompt token i + 1).
    """
    # logits: [N, V] raw, as the model computed them
    ### BEGIN SOLUTION 2.5
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)  # [N]
    chosen = logprobs.gather(-1, ids[:, None])[:, 0]  # [N]
    top_values, top_ids = torch.topk(logprobs, k, dim=-1)  # [N, k], sorted best first
    ### END SOLUTION
    return [
        TokenLogprobs(token_id, logprob, list(zip(ids, values, strict=True)))
        for token_id, logprob, ids, values in zip(token_ids, chosen.tolist(), top_ids.tolist(), top_values.tolist(),
                                                  strict=True)
    ]
