"""The sampler and verification wait for the GPU once per step, whatever the batch and the guesses.

On CUDA every host read of a tensor, every copy from a Python list to the device and every device
tensor indexed with a list makes the CPU wait for the GPU (see ``syncs.py``): a step that does it per
row or per guess spends its time waiting. Counted here on the CPU with a stub, on batches of 8 and 64
rows of every kind of request (greedy, temperature, top-k, top-p, penalties and bias, seeded or not):
the counts must not grow with the batch or with the guesses. And the random draws are batched as far as
a seed allows: one per seeded request, one for all the others, while a seeded request keeps giving the
same tokens whatever shares its batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from .conftest import stage
from .stages import has, stages_having
from .syncs import count_syncs

SAMPLE_STAGES = [folder for folder in stages_having("batching") if not has(folder, "speculation")]
VERIFY_STAGES = stages_having("speculation")
VOCAB = 50
K = 4  # guesses per sequence


def mixed_params(sampler, rows: int) -> list:
    """``rows`` requests of every kind; every other one seeded (5 kinds, so each kind comes seeded and not)."""
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=5),
             dict(temperature=1.2, top_p=0.7),
             dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={3: 2.0, 7: -1.0})]
    return [sampler.SamplingParams(**kinds[i % len(kinds)], seed=100 + i if i % 2 else None) for i in range(rows)]


def own_draws(params: list, guesses: list[int]) -> int:
    """The random fills a batch needs at the least: a seeded sampling request draws on its own (its uniforms, if
    it guessed, then its noise); every unseeded one shares one fill of each kind."""
    sampled = [(p, k) for p, k in zip(params, guesses, strict=True) if not p.greedy]
    seeded = sum(1 + (k > 0) for p, k in sampled if p.seed is not None)
    unseeded = [k for p, k in sampled if p.seed is None]
    return seeded + (1 + (max(guesses) > 0) if unseeded else 0)


def histories(rows: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (i % 6,), generator=generator).tolist() for i in range(rows)]


# --- stages 04 to 07: sample ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [8, 64])
@pytest.mark.parametrize("folder", SAMPLE_STAGES)
def test_sampling_a_batch_reads_the_tokens_once_and_copies_nothing_the_slow_way(folder, rows):
    sampler = stage(folder, "sampler")
    params = mixed_params(sampler, rows)
    generators = [sampler.make_generator(p.seed) for p in params]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
    outputs = histories(rows)
    with count_syncs() as syncs:
        tokens = sampler.sample(logits, params, generators, outputs)
    assert len(tokens) == rows
    assert syncs.reads == 1, f"one read (the tokens), not {syncs.calls}"
    assert syncs.copies == 0 and syncs.list_indexing == 0, syncs.calls
    assert syncs.draws == own_draws(params, [0] * rows), "one draw per seeded row, one for all the others"


@pytest.mark.parametrize("folder", SAMPLE_STAGES)
def test_a_seeded_row_samples_the_same_token_alone_and_in_a_batch(folder):
    sampler = stage(folder, "sampler")
    params = mixed_params(sampler, 10)
    logits = torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(0))
    outputs = histories(10)
    for _ in range(5):  # a few steps, the generators moving on
        in_batch = sampler.sample(logits, params, [sampler.make_generator(p.seed) for p in params], outputs)
        for row, p in enumerate(params):
            if p.seed is not None:
                alone = sampler.sample(logits[row : row + 1], [p], [sampler.make_generator(p.seed)], [outputs[row]])
                assert alone == [in_batch[row]], row
        logits = logits.roll(1, dims=-1)


@pytest.mark.parametrize("rows", [8, 64])
@pytest.mark.parametrize("folder", stages_having("batching"))
def test_logprobs_of_a_batch_are_read_back_in_two_reads(folder, rows):
    sampler = stage(folder, "sampler")
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
    ks = [[None, 0, 1, 5][row % 4] for row in range(rows)]
    token_ids = [row % VOCAB for row in range(rows)]
    with count_syncs() as syncs:
        got = sampler.compute_logprobs(logits, token_ids, ks)
    assert syncs.reads <= 2 and syncs.copies == 0 and syncs.list_indexing == 0, syncs.calls
    logprobs = torch.log_softmax(logits, dim=-1)
    for row, k in enumerate(ks):
        assert (got[row] is None) == (k is None)
        if got[row] is not None:
            assert got[row].logprob == pytest.approx(float(logprobs[row, token_ids[row]]))
            assert [token for token, _ in got[row].top] == torch.topk(logprobs[row], k).indices.tolist()


# --- stages 08 on: verify ---------------------------------------------------------------------------------------


def a_step(sampler, seqs: int, seed: int = 0) -> dict:
    """verify's arguments for ``seqs`` sequences of every kind: most guess K tokens, some fewer or none; half the
    guessers have a draft model's distributions, half are n-gram guesses (no distribution)."""
    generator = torch.Generator().manual_seed(seed)
    params = mixed_params(sampler, seqs)
    guesses = [K if s % 3 else s % K for s in range(seqs)]
    drafts = [torch.randint(VOCAB, (k,), generator=generator).tolist() for k in guesses]
    draft_probs = [torch.softmax(torch.randn(k, VOCAB, generator=generator), dim=-1) if s % 4 < 2 and k else None
                   for s, k in enumerate(guesses)]
    logits = torch.randn(sum(1 + k for k in guesses), VOCAB, generator=generator) * 2
    return dict(logits=logits, params=params, drafts=drafts, draft_probs=draft_probs, histories=histories(seqs))


def generators_for(sampler, params: list) -> list[torch.Generator]:
    return [sampler.make_generator(p.seed if p.seed is not None else 7) for p in params]


@pytest.mark.parametrize("seqs", [8, 64])
@pytest.mark.parametrize("folder", VERIFY_STAGES)
def test_verifying_a_batch_of_guesses_reads_back_once_and_copies_nothing_the_slow_way(folder, seqs):
    speculative, sampler = stage(folder, "speculative"), stage(folder, "sampler")
    step = a_step(sampler, seqs)
    with count_syncs() as syncs:
        runs = speculative.verify(**step, generators=generators_for(sampler, step["params"]))
    for draft, run in zip(step["drafts"], runs, strict=True):
        assert 1 <= len(run) <= len(draft) + 1 and run[:-1] == draft[: len(run) - 1]
    assert syncs.reads == 1, f"one read for the whole step, not {syncs.calls}"
    assert syncs.copies == 0 and syncs.list_indexing == 0, syncs.calls
    assert syncs.draws == own_draws(step["params"], [len(draft) for draft in step["drafts"]]), syncs.calls


@pytest.mark.parametrize("folder", VERIFY_STAGES)
def test_a_seeded_sequence_verifies_to_the_same_run_alone_and_in_a_batch(folder):
    """Uniforms and noise are drawn for many sequences at once: a seeded sequence's must still be its own."""
    speculative, sampler = stage(folder, "speculative"), stage(folder, "sampler")
    for seed in range(3):
        step = a_step(sampler, 12, seed)
        in_batch = speculative.verify(**step, generators=generators_for(sampler, step["params"]))
        start = 0
        for s, (p, draft) in enumerate(zip(step["params"], step["drafts"], strict=True)):
            rows = step["logits"][start : start + 1 + len(draft)]
            start += 1 + len(draft)
            if p.seed is None:
                continue
            alone = speculative.verify(rows, [p], [draft], [step["draft_probs"][s]], [step["histories"][s]],
                                       [sampler.make_generator(p.seed)])
            assert alone == [in_batch[s]], (seed, s)


# --- on a GPU: the real thing -----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("folder", [SAMPLE_STAGES[-1], VERIFY_STAGES[0]])
def test_on_cuda_a_step_of_sampling_synchronizes_once(folder):
    """What the stub counts, checked by CUDA itself: PyTorch's sync debug mode warns at every call that makes the
    CPU wait for the GPU. A first run, unwatched, warms up the kernels."""
    sampler = stage(folder, "sampler")
    if has(folder, "speculation"):
        speculative = stage(folder, "speculative")
        step = a_step(sampler, 64)
        step = {**step, "logits": step["logits"].cuda(),
                "draft_probs": [probs if probs is None else probs.cuda() for probs in step["draft_probs"]]}
        params = step["params"]

        def run(generators: list[torch.Generator]) -> list:
            return speculative.verify(**step, generators=generators)
    else:
        params = mixed_params(sampler, 64)
        logits, outputs = torch.randn(64, VOCAB, device="cuda"), histories(64)

        def run(generators: list[torch.Generator]) -> list:
            return sampler.sample(logits, params, generators, outputs)
    warm, watched = ([sampler.make_generator(p.seed, "cuda") for p in params] for _ in range(2))
    run(warm)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(watched)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # One warning per synchronizing call; the first use of the mode also warns that it is a prototype.
    waits = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(waits) == 1, waits
