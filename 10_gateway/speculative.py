"""Verification: one forward pass checks k guessed tokens, and keeps exactly what the model would have produced.

A proposer (``proposer.py``) guesses the next k tokens of a sequence, d1 .. dk. The step then runs the
sequence's last token *and* the guesses, k + 1 rows, as a short prefill over the paged cache. Row i
sees the sequence plus d1 .. di, so its logits are what a plain decode step would have seen after
accepting those i guesses::

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import SamplingParams, apply_penalties, logits_to_probs

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


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` [V], with noise from the sequence's own stream (the sampler's exponential race,
    so that a step without guesses draws exactly what stage 07 would)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


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


def accept_sampled(draft: list[int], p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """Rejection sampling: the emitted tokens have exactly the model's distribution, whatever the guesses.

    p: [k + 1, V], the model's distributions row by row; q: [k, V], the proposer's, or None for a proposer
    that guesses without a distribution (n-gram: q is one-hot at the guess, so a guess x is accepted with
    probability p(x), and the residual is p with x removed). Draws come from ``generator`` in a fixed
    order, so a seeded request is reproducible."""
    k = len(draft)
    assert p.shape[0] == k + 1 and (q is None or q.shape[0] == k), "one row of p per guess, plus one"
    emitted: list[int] = []
    ### BEGIN SOLUTION 8.3
    for i, x in enumerate(draft):
        q_x = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_x < float(p[i, x]):  # u < p(x) / q(x), without dividing by a q of 0
            emitted.append(x)
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0  # max(0, p - onehot(x)): all of x's mass goes
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        emitted.append(draw(residual / residual.sum(), generator))
        return emitted
    emitted.append(draw(p[k], generator))  # all k accepted: the bonus token, from the last row
    ### END SOLUTION
    return emitted


def verify(logits: torch.Tensor, params: list[SamplingParams], drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None], histories: list[list[int]],
           generators: list[torch.Generator]) -> list[list[int]]:
    """Every sampling sequence's tokens for this step: 1 to k + 1 each, by its own acceptance rule.

    ``logits`` has 1 + len(drafts[s]) rows per sequence s, in order; row i of s is what the model predicts
    after ``histories[s]`` (its output so far) and ``drafts[s][:i]``, and penalties see exactly that."""
    # logits: [R, V], R = sum(1 + k_s)
    rows = [1 + len(draft) for draft in drafts]
    assert logits.shape[0] == sum(rows), f"{logits.shape[0]} rows of logits for {sum(rows)}"
    row_params = [p for p, n in zip(params, rows, strict=True) for _ in range(n)]
    row_histories = [history + draft[:i] for history, draft in zip(histories, drafts, strict=True)
                     for i in range(len(draft) + 1)]
    logits = apply_penalties(logits, row_params, row_histories)  # [R, V]
    choices = torch.argmax(logits, dim=-1).tolist()  # [R]: what greedy rows need
    drawn = [r for r, p in enumerate(row_params) if not p.greedy]
    probs = dict(zip(drawn, logits_to_probs(logits[drawn], [row_params[r] for r in drawn]), strict=True)) \
        if drawn else {}
    emitted, start = [], 0
    for s, (param, draft) in enumerate(zip(params, drafts, strict=True)):
        end = start + rows[s]
        if param.greedy:
            emitted.append(accept_greedy(draft, choices[start:end]))
        else:
            p = torch.stack([probs[r] for r in range(start, end)])  # [k + 1, V]
            emitted.append(accept_sampled(draft, p, draft_probs[s], generators[s]))
        start = end
    return emitted
