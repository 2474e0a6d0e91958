"""Sampling, batched: what each sequence's logits become before a token is chosen.

Every request of a batch brings its own parameters. First the penalties and ``logit_bias`` of the
rows that have them adjust their logits, in one operation for all of them. Greedy rows
(temperature 0) take the argmax. The others are divided by their temperature, cut down to their
``top_k`` best tokens and to the smallest set whose probability reaches their ``top_p``, all rows
at once. The token itself is chosen by verification (``speculative.py``): a row without guesses
draws one token with noise (``race_noise``): a seeded request's from *its own* random stream, so
that it gives the same text whatever else shares its batch, the unseeded rows' from one draw for
all of them.

On a GPU nothing here stalls the CPU: the per-row numbers (temperatures, row indices, ...) go over
in asynchronous copies from page-locked memory (``to_device``), no device tensor is indexed with a
Python list (which would copy the list the slow way first), and the only reads back to the host
are the logprobs a request asked for.

A *logprob* is the log-softmax of the raw logits, before penalties, temperature, top-k and top-p
(vLLM's convention), in float32; it is computed only for the rows whose requests asked for it.
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


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Python numbers as a tensor on ``device``, without stalling the CPU.

    ``torch.tensor(values, device="cuda")`` copies from ordinary (pageable) memory, and such a copy waits
    until the GPU has finished everything queued before it: the CPU could no longer run ahead. Built in
    page-locked (pinned) memory instead, the tensor goes over with an asynchronous copy, queued behind the
    GPU's work (vLLM's ``async_tensor_h2d``). On the CPU it is just ``torch.tensor``."""
    pinned = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return pinned.to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], output_ids: list[list[int]]) -> torch.Tensor:
    """OpenAI's penalties over each row's generated tokens, then ``logit_bias``; before temperature.

    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0), then += bias[t].
    The counts of every penalized row come from one scatter over their output ids, padded to the
    longest (padding adds 0), and every bias of the batch goes in with one indexed add.
    """
    # logits: [B, V]; output_ids: B lists, the tokens each row has generated so far
    if not any(p.penalized for p in params):
        return logits
    device = logits.device
    logits = logits.float().clone()  # the raw logits stay as they are: logprobs are computed from them
    rows = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and output_ids[i]]
    if rows:
        width = max(len(output_ids[i]) for i in rows)
        ids = to_device([output_ids[i] + [0] * (width - len(output_ids[i])) for i in rows], torch.int64, device)
        real = to_device([[1.0] * len(output_ids[i]) + [0.0] * (width - len(output_ids[i])) for i in rows],
                         torch.float32, device)
        counts = torch.zeros(len(rows), logits.shape[-1], device=device).scatter_add_(1, ids, real)  # [b, V]
        # frequency and presence: [2, b]
        frequency, presence = to_device([[params[i].frequency_penalty for i in rows],
                                         [params[i].presence_penalty for i in rows]], torch.float32, device)
        penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0).float()  # [b, V]
        logits.index_add_(0, to_device(rows, torch.int64, device), -penalty)
    biased = [(i, token_id, bias) for i, p in enumerate(params) for token_id, bias in p.logit_bias.items()]
    if biased:
        rows_and_ids = to_device([[i for i, _, _ in biased], [t for _, t, _ in biased]], torch.int64, device)
        biases = to_device([bias for _, _, bias in biased], torch.float32, device)
        logits.index_put_(tuple(rows_and_ids), biases, accumulate=True)
    return logits


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
    # Every row's settings in one copy. top_k is clamped to the vocabulary first (any larger k means "keep
    # all", and may not fit in int64), which also keeps it exact in float32.
    vocab = logits.shape[-1]
    settings = [[p.temperature for p in params], [min(p.top_k, vocab) for p in params], [p.top_p for p in params]]
    temperature, top_k, top_p = to_device(settings, torch.float32, logits.device)  # [B] each
    logits = logits.float() / temperature[:, None]
    if any(p.top_k > 0 for p in params):
        logits = apply_top_k(logits, top_k.long())
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, top_p)
    return torch.softmax(logits, dim=-1)


def race_noise(vocab: int, seeded: list[bool], generators: list[torch.Generator],
               device: torch.device) -> torch.Tensor:
    """The noise of the exponential race, E ~ Exp(1) for every row and token: ``argmax(p / E)`` picks token i
    with probability p_i (p need not even be normalized).

    A seeded request's row comes from its own generator, one draw (one kernel launch) per seeded row, so that
    no other row can change it. The unseeded rows need no such guarantee: they share one draw for all of
    them, from the first unseeded row's generator (every generator of an unseeded request is seeded at random)."""
    noise = torch.empty(len(seeded), vocab, device=device)  # [B, V]
    unseeded = [generator for own, generator in zip(seeded, generators, strict=True) if not own]
    if unseeded:
        noise.exponential_(generator=unseeded[0])  # every row at once; a seeded row is drawn again below
    for row, (own, generator) in enumerate(zip(seeded, generators, strict=True)):
        if own:
            noise[row].exponential_(generator=generator)
    return noise


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int | None]) -> list[TokenLogprobs | None]:
    """For each row that asked (``ks[row]`` not None): the logprob of ``token_ids[row]`` and the
    ``ks[row]`` most likely tokens, best first. Rows that did not ask cost nothing and get None."""
    # logits: [B, V] raw, as the model computed them
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return [None] * len(ks)
    ids = to_device([token_ids[i] for i in rows], torch.int64, logits.device)  # [b]
    values, top_ids = logprob_tensors(logits, rows, ids, max(ks[i] for i in rows))
    return unpack_logprobs(token_ids, ks, values.tolist(), top_ids.tolist())  # two reads in all, whatever b


def logprob_tensors(logits: torch.Tensor, rows: list[int], ids: torch.Tensor,
                    widest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's half of ``compute_logprobs``, for the ``rows`` of ``logits`` that asked, whose chosen tokens are
    ``ids`` (on the device: the host need not know them yet). Returns, unread, each row's chosen logprob then its
    ``widest`` best ([b, 1 + widest] float32), and those best tokens' ids ([b, widest] int64)."""
    indices = to_device(rows, torch.int64, logits.device)  # [b]
    logprobs = torch.log_softmax(logits.index_select(0, indices).float(), dim=-1)  # [b, V]
    chosen = logprobs.gather(-1, ids[:, None])  # [b, 1]
    top_values, top_ids = torch.topk(logprobs, widest, dim=-1)  # [b, widest], sorted best first
    return torch.cat([chosen, top_values], dim=-1), top_ids


def unpack_logprobs(token_ids: list[int], ks: list[int | None], values: list[list[float]],
                    top_ids: list[list[int]]) -> list[TokenLogprobs | None]:
    """The host's half: ``logprob_tensors``' rows, read, as one ``TokenLogprobs`` per row that asked (None for the
    others). Row j of ``values`` and ``top_ids`` belongs to the j-th row whose ``ks`` is not None."""
    results: list[TokenLogprobs | None] = [None] * len(ks)
    rows = [i for i, k in enumerate(ks) if k is not None]
    for j, i in enumerate(rows):
        k = ks[i]
        top = list(zip(top_ids[j][:k], values[j][1 : k + 1], strict=True))
        results[i] = TokenLogprobs(token_ids[i], values[j][0], top)
    return results
