"""The sampler of every stage: top-k and top-p keep exactly the right tokens, temperature reshapes the
distribution as it should, and a seed makes sampling repeatable."""

from __future__ import annotations

import pytest
import torch

from .sampling import OneRow
from .stages import graded_first, stages_with

STAGES = stages_with("sampler")


@pytest.fixture(params=STAGES)
def sampler(request):
    return OneRow(request.param)


def graded(exercise: str) -> pytest.MarkDecorator:
    """Run on every stage; stage 01's run grades homework ``exercise`` (later stages copy 01's code)."""
    return pytest.mark.parametrize("sampler", graded_first(STAGES, exercise), indirect=True)


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


LOGITS = torch.tensor([2.0, 0.5, 3.0, -1.0, 1.0, 2.5])  # ranks: 2, 5, 0, 4, 1, 3


@graded("1.1")
def test_top_k_keeps_exactly_the_k_best(sampler):
    params = sampler.SamplingParams(temperature=1.0, top_k=3)
    assert kept(sampler.logits_to_probs(LOGITS, params)) == {2, 5, 0}


@graded("1.1")
def test_top_k_with_ties_keeps_exactly_k(sampler):
    params = sampler.SamplingParams(temperature=1.0, top_k=2)
    assert len(kept(sampler.logits_to_probs(torch.tensor([1.0, 1.0, 1.0, 0.0]), params))) == 2


def test_top_k_zero_or_minus_one_keeps_everything(sampler):
    for k in (0, -1):
        assert kept(sampler.logits_to_probs(LOGITS, sampler.SamplingParams(top_k=k))) == set(range(6))


@graded("1.2")
def test_top_p_keeps_the_smallest_set_reaching_p(sampler):
    probs = torch.softmax(LOGITS, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    cumulative = torch.cumsum(probs[order], dim=0).tolist()
    for top_p in (0.05, 0.3, 0.5, 0.7, 0.9, 0.99):
        n = next(i + 1 for i, c in enumerate(cumulative) if c >= top_p)  # smallest prefix reaching p
        got = kept(sampler.logits_to_probs(LOGITS, sampler.SamplingParams(top_p=top_p)))
        assert got == set(order[:n]), top_p


@graded("1.1")
def test_kept_tokens_are_renormalised_in_proportion(sampler):
    probs = sampler.logits_to_probs(LOGITS, sampler.SamplingParams(top_k=2))
    full = torch.softmax(LOGITS, dim=-1)
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    assert torch.isclose(probs[2] / probs[5], full[2] / full[5])


@graded("1.2")
def test_top_p_masks_logits_and_leaves_the_kept_ones_alone(sampler):
    # apply_top_p works on logits: the kept ones come back unchanged, the dropped ones become -inf.
    out = sampler.apply_top_p(LOGITS, 0.7)  # probabilities 0.45 + 0.27 reach 0.7: tokens 2 and 5
    assert torch.equal(out[[2, 5]], LOGITS[[2, 5]])
    assert torch.isneginf(out[[0, 1, 3, 4]]).all()


@graded("1.2")
def test_top_k_then_top_p(sampler):
    # top-k 4 leaves {2, 5, 0, 4}; of those, top-p 0.6 needs the two best.
    probs = sampler.logits_to_probs(LOGITS, sampler.SamplingParams(top_k=4, top_p=0.6))
    assert kept(probs) == {2, 5}


def entropy(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def test_temperature_sharpens_and_flattens(sampler):
    def probs(t: float) -> torch.Tensor:
        return sampler.logits_to_probs(LOGITS, sampler.SamplingParams(temperature=t))

    assert torch.allclose(probs(1.0), torch.softmax(LOGITS, dim=-1))
    assert torch.allclose(probs(0.5), torch.softmax(LOGITS / 0.5, dim=-1))
    entropies = [entropy(probs(t)) for t in (0.25, 0.5, 1.0, 2.0)]
    assert entropies == sorted(entropies)  # hotter is flatter
    assert probs(0.05)[2] > 0.99  # near zero is nearly greedy


def test_greedy_is_argmax(sampler):
    params = sampler.SamplingParams(temperature=0.0)
    gen = sampler.make_generator(0)
    assert sampler.sample(LOGITS, params, gen) == 2


@graded("1.1")
def test_sampling_follows_the_distribution(sampler):
    params = sampler.SamplingParams(temperature=1.0, top_k=3)
    gen = sampler.make_generator(1234)
    draws = torch.tensor([sampler.sample(LOGITS, params, gen) for _ in range(3000)])
    expected = sampler.logits_to_probs(LOGITS, params)
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert set(draws.tolist()) <= {0, 2, 5}
    assert torch.allclose(freq, expected, atol=0.03)


def test_same_seed_same_tokens(sampler):
    params = sampler.SamplingParams(temperature=1.5)
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def draw(seed: int) -> list[int]:
        gen = sampler.make_generator(seed)
        return [sampler.sample(logits, params, gen) for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_extreme_but_valid_parameters_still_give_a_distribution(sampler):
    """Found by the fuzz: a temperature of 1e-300 made inf - inf (it is 0 in float32), and a top_p of
    5e-324 dropped every token (rounding left the best token's mass-before a hair above 0)."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 10
    best = int(torch.argmax(logits))
    assert sampler.SamplingParams(temperature=1e-300).greedy
    assert sampler.sample(logits, sampler.SamplingParams(temperature=1e-300), torch.Generator()) == best
    for params in (sampler.SamplingParams(temperature=sampler.MIN_TEMPERATURE),
                   sampler.SamplingParams(temperature=1.0, top_p=5e-324)):
        probs = sampler.logits_to_probs(logits, params)
        assert torch.isfinite(probs).all() and kept(probs) == {best}
