"""Verification: one forward pass checks k guessed tokens, and keeps what the model would have produced.

A proposer (``proposer.py``) guesses the next k tokens of a sequence, d1 .. dk. The step then runs the
sequence's last token *and* the guesses, k + 1 rows, as a short prefill over the paged cache. Row i
sees the sequence plus d1 .. di, so its logits are what a plain decode step would have seen after
accepting those i guesses, to float32 rounding (a product of more rows may sum in another order, which can
tip a near-tie between two tokens, as chunked prefill and padded buckets can)::

    cache: t1 .. t(L-1)        this step's rows:  [ tL | d1  d2  d3  d4 ]   (k = 4: five rows)
    the model's token per row:                    [ a0 | a1  a2  a3  a4 ]
    greedy: d1 == a0? d2 == a1? ... keep the guesses up to the first mismatch, then emit the model's own
    token there; if all k match, a4 comes free (the "bonus" token). 1 to k + 1 tokens per step.

At low concurrency a decode step is bound by reading the weights, not by arithmetic: five rows cost
little more than one, so every accepted guess is a token for (almost) nothing.

Sampling keeps the model's distribution exactly, whatever the proposer (rejection sampling, Leviathan
et al. 2023 and Chen et al. 2023). With p the model's distribution at a row and q the proposer's:
accept the guess x with probability min(1, p(x) / q(x)); at the first rejection draw from the residual
max(0, p - q), normalized; after k acceptances draw the bonus token from p. Why it is exact, in one
line: a token y comes out either accepted, with probability q(y) min(1, p(y)/q(y)) = min(q(y), p(y)),
or from the residual, with probability (1 - sum_z min(q(z), p(z))) * max(0, p(y) - q(y)) / sum_z max(0,
p(z) - q(z)); the two sums are equal (both are 1 minus the overlap of p and q), so the second term is
max(0, p(y) - q(y)), and min(q, p) + max(0, p - q) = p(y).

On a GPU a step's verification waits for the GPU once, to read every sequence's run back: the tests of
all the guesses of all the sequences are tensor operations over [S, K] (sequences, guesses), the
uniforms and the noise are drawn for many rows at once (a draw per seeded sequence, one for all the
unseeded ones), and only the outcome, two numbers per sequence, comes back to the host.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .sampler import SamplingParams, apply_penalties, logits_to_probs, race_noise, to_device

# Each sequence's acceptance rate, the chance that one of its guesses is kept: what the policy (policy.py) expects its
# next guesses to be worth. Before its first verification a sequence gets the benefit of the doubt: on this course's
# CPU, enough for guesses to pay at small batches, not at large ones (n-gram guesses on text that copies its prompt
# are kept at about 0.75 each).
PRIOR_ACCEPTANCE = 0.6
ACCEPTANCE_WEIGHT = 0.25  # the weight of the newest verification in the running rate
DRIFT = 0.03  # a step without guesses moves the rate this share of the way back to the prior: a sequence written off
# is tried again some tens of steps later (its text may have started to copy something)


@dataclass
class Proposal:
    """A sequence's guesses for one step, and the distributions they were drawn from (None: no distribution,
    as for n-gram guesses, or a greedy draft: then acceptance needs only the tokens)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), V]


@dataclass
class Speculation:
    """One sequence's speculation: the most tokens it may guess in a step, and how often its guesses are kept."""

    num_tokens: int  # k: the most guesses per step (0: speculation is off); the policy chooses 0 to k each step
    acceptance: float = PRIOR_ACCEPTANCE  # running (exponentially weighted) estimate of the chance a guess is kept

    def record(self, proposed: int, accepted: int) -> None:
        """A step's outcome. A verification updates the rate; a step without guesses lets it drift back to the prior.

        The guesses after the first rejected one were never tested (the model's own token had replaced the run), so
        ``accepted`` kept of ``proposed`` is ``accepted`` successes in ``accepted + 1`` trials (``accepted`` if all
        were kept)."""
        if proposed == 0:
            self.acceptance += DRIFT * (PRIOR_ACCEPTANCE - self.acceptance)
            return
        tested = accepted + (accepted < proposed)
        self.acceptance += ACCEPTANCE_WEIGHT * (accepted / tested - self.acceptance)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token from ``probs`` [V], with noise from the sequence's own stream: the sampler's exponential race, for a
    proposer that samples its guesses one at a time. A 0-d tensor on ``probs``' device: nothing is read back."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / noise)


def accept_greedy(draft: list[int], choices: list[int]) -> list[int]:
    """The tokens one greedy step emits: the guesses while they equal the model's choice, then its choice.

    ``choices[i]`` is the model's argmax after the sequence and ``draft[:i]``: len(choices) == len(draft) + 1."""
    assert len(choices) == len(draft) + 1, f"{len(choices)} rows for {len(draft)} guesses"
    ### BEGIN SOLUTION 8.2
    emitted = []
    for guess, choice in zip(draft, choices, strict=False):
        emitted.append(choice)
        if guess != choice:
            return emitted  # the model's own token where the guess went wrong; the rest are discarded
    return emitted + [choices[-1]]  # every guess accepted: the last row's token is a bonus
    ### END SOLUTION


def rejection_sample(guesses: torch.Tensor, proposed: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                     uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for S sequences at once: how many guesses each keeps, and what its next token is drawn from.

    Sequence s guessed ``proposed[s]`` tokens, ``guesses[s, :proposed[s]]`` (the columns past them are padding). Its
    rows: ``p[s, i]``, the model's distribution after the guesses before i; ``q[s, i]``, the proposer's distribution
    that guess i was drawn from (one-hot at the guess for a proposer without one); ``q`` is 0 at row ``proposed[s]``,
    which checks no guess. Guess x is accepted if ``uniforms[s, i] * q(x) < p(x)``, with probability
    min(1, p(x) / q(x)) (written without dividing by a q of 0), and the sequence keeps its guesses up to the first
    rejected one. Its next token comes from the residual max(0, p - q) at that row; when every guess was kept, at row
    ``proposed[s]`` where q is 0, the residual is p itself: the bonus token. The weights are not normalized: the
    exponential race needs no normalizing."""
    # guesses, uniforms: [S, K]; proposed: [S]; p, q: [S, K + 1, V] -> accepted: [S], weights: [S, V]
    ### BEGIN SOLUTION 8.3
    p_x = p[:, :-1].gather(-1, guesses[..., None])[..., 0]  # [S, K]: p(x) at each guess x
    q_x = q[:, :-1].gather(-1, guesses[..., None])[..., 0]  # [S, K]: q(x)
    columns = torch.arange(guesses.shape[1], device=guesses.device)  # [K]
    passed = (uniforms * q_x < p_x) & (columns[None, :] < proposed[:, None])  # [S, K]; padding never passes
    accepted = passed.long().cumprod(dim=-1).sum(dim=-1)  # [S]: the guesses before the first rejection
    at = accepted[:, None, None].expand(-1, 1, p.shape[-1])  # [S, 1, V]: the row the next token comes from
    weights = (p.gather(1, at) - q.gather(1, at)).clamp_min(0.0)[:, 0]  # [S, V]: max(0, p - q) at that row
    ### END SOLUTION
    return accepted, weights


def guess_uniforms(proposed: list[int], seeded: list[bool], generators: list[torch.Generator],
                   device: torch.device) -> torch.Tensor:
    """[S, K]: one uniform draw in [0, 1) per guess (K the most guesses; the rest is padding), as the sampler draws
    its noise (``race_noise``): a seeded sequence's from its own generator, the unseeded ones' in one draw."""
    uniforms = torch.empty(len(proposed), max(proposed), device=device)
    unseeded = [generator for own, generator in zip(seeded, generators, strict=True) if not own]
    if unseeded and uniforms.numel():
        uniforms.uniform_(generator=unseeded[0])  # every row at once; a seeded row is drawn again below
    for row, (k, own, generator) in enumerate(zip(proposed, seeded, generators, strict=True)):
        if own and k:
            uniforms[row, :k].uniform_(generator=generator)
    return uniforms


def sample_runs(p: torch.Tensor, drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                seeded: list[bool], generators: list[torch.Generator]) -> torch.Tensor:
    """[S, 2], on p's device: how many of its guesses each sampling sequence keeps, and its next token.

    ``p``: [S, K + 1, V], each sequence's rows padded to the most guesses K (past a sequence's last row, anything).
    A seeded sequence draws its uniforms, then its noise, from its own generator: its run does not depend on the
    other sequences of the step."""
    num_seqs, vocab, device = p.shape[0], p.shape[-1], p.device
    proposed = [len(draft) for draft in drafts]
    most = max(proposed)
    # guesses: [S, K], padded with token 0; n-gram guesses (no distribution) are a one-hot q, weight 1 at the guess
    guesses = to_device([draft + [0] * (most - len(draft)) for draft in drafts], torch.int64, device)
    one_hot = to_device([[float(probs is None and i < len(draft)) for i in range(most)]
                         for draft, probs in zip(drafts, draft_probs, strict=True)], torch.float32, device)
    q = torch.zeros(num_seqs, most + 1, vocab, device=device)  # [S, K + 1, V]; row k_s stays 0: no guess there
    q[:, :most].scatter_(-1, guesses[..., None], one_hot[..., None])
    for row, probs in enumerate(draft_probs):
        if probs is not None:
            q[row, : probs.shape[0]] = probs  # a draft model's distributions
    uniforms = guess_uniforms(proposed, seeded, generators, device)  # [S, K]
    accepted, weights = rejection_sample(guesses, to_device(proposed, torch.int64, device), p, q, uniforms)
    noise = race_noise(vocab, seeded, generators, device)  # [S, V]
    return torch.stack([accepted, torch.argmax(weights / noise, dim=-1)], dim=-1)  # the exponential race


def accept_sampled(draft: list[int], p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """Rejection sampling for one sequence: the emitted tokens have exactly the model's distribution, whatever the
    guesses (``verify`` runs every sampling sequence of a step through the same ``sample_runs`` at once).

    p: [k + 1, V], the model's distributions row by row; q: [k, V], the proposer's, or None for a proposer
    that guesses without a distribution (n-gram: q is one-hot at the guess, so a guess x is accepted with
    probability p(x), and the residual is p with x removed). Draws come from ``generator`` in a fixed
    order (the uniforms, then the noise), so a seeded request is reproducible."""
    k = len(draft)
    assert p.shape[0] == k + 1 and (q is None or q.shape[0] == k), "one row of p per guess, plus one"
    accepted, token = sample_runs(p[None], [draft], [q], [True], [generator])[0].tolist()
    return draft[:accepted] + [token]


def next_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """[S] int64, on the device: each sequence's next token from its row of ``logits`` [S, V], drawn exactly as
    ``verify`` draws for a sequence without guesses, and left there, unread: the step after takes its input ids
    from it, and the host reads it one step later (overlap scheduling). No penalties: they need every token the
    sequence has, and the last one is on the device (such a step does not overlap)."""
    assert not any(p.penalized for p in params), "penalties need the whole history on the host"
    choices = torch.argmax(logits, dim=-1)  # [S]: what greedy sequences need
    sampling = [s for s, param in enumerate(params) if not param.greedy]
    if sampling:
        rows = to_device(sampling, torch.int64, logits.device)  # [n]
        p = logits_to_probs(logits.index_select(0, rows), [params[s] for s in sampling])  # [n, V]
        runs = sample_runs(p[:, None], [[] for _ in sampling], [None for _ in sampling],
                           [params[s].seed is not None for s in sampling], [generators[s] for s in sampling])
        choices[rows] = runs[:, 1]  # [n, 2]: no guesses kept, and the token
    return choices


def verify(logits: torch.Tensor, params: list[SamplingParams], drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None], histories: list[list[int]],
           generators: list[torch.Generator]) -> list[list[int]]:
    """Every sampling sequence's tokens for this step: 1 to k + 1 each, by its own acceptance rule.

    ``logits`` has 1 + len(drafts[s]) rows per sequence s, in order; row i of s is what the model predicts
    after ``histories[s]`` (its output so far) and ``drafts[s][:i]``, and penalties see exactly that. The greedy
    sequences' choices and the sampling sequences' runs come back to the host together, in one read."""
    # logits: [R, V], R = sum(1 + k_s)
    rows = [1 + len(draft) for draft in drafts]
    assert logits.shape[0] == sum(rows), f"{logits.shape[0]} rows of logits for {sum(rows)}"
    row_params = [p for p, n in zip(params, rows, strict=True) for _ in range(n)]
    row_histories = [history + draft[:i] for history, draft in zip(histories, drafts, strict=True)
                     for i in range(len(draft) + 1)]
    logits = apply_penalties(logits, row_params, row_histories)  # [R, V]
    choices = torch.argmax(logits, dim=-1)  # [R]: what greedy sequences need
    starts = [0, *itertools.accumulate(rows)][:-1]  # each sequence's first row
    sampling = [s for s, param in enumerate(params) if not param.greedy]
    runs = choices.new_zeros(0, 2)  # [S, 2]: guesses kept and the next token, per sampling sequence
    if sampling:
        most = max(len(drafts[s]) for s in sampling)
        # Each sampling sequence's rows, padded to 1 + K with its last row: [S, 1 + K]
        padded = [[starts[s] + min(i, len(drafts[s])) for i in range(most + 1)] for s in sampling]
        p = logits_to_probs(logits.index_select(0, to_device(padded, torch.int64, logits.device).flatten()),
                            [params[s] for s in sampling for _ in range(most + 1)])  # [S * (1 + K), V]
        runs = sample_runs(p.view(len(sampling), most + 1, -1), [drafts[s] for s in sampling],
                           [draft_probs[s] for s in sampling], [params[s].seed is not None for s in sampling],
                           [generators[s] for s in sampling])
    read = torch.cat([choices, runs.flatten()]).tolist()  # the step's one wait for the GPU
    choices, outcomes = read[: len(choices)], read[len(choices) :]
    runs_of = dict(zip(sampling, zip(outcomes[::2], outcomes[1::2], strict=True), strict=True))
    emitted = []
    for s, draft in enumerate(drafts):
        if s in runs_of:
            accepted, token = runs_of[s]
            emitted.append(draft[:accepted] + [token])
        else:
            emitted.append(accept_greedy(draft, choices[starts[s] : starts[s] + rows[s]]))
    return emitted
