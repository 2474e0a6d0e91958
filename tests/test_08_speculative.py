"""Stage 08: speculative decoding. A proposer guesses, one pass checks, verification keeps the model's output.

The pieces alone (the n-gram matcher and the proposer's incremental index, both acceptance rules, the scheduler's
room for guesses and what an empty proposal counts for, each sequence's acceptance rate and the policy that decides
how many guesses pay), steps with guesses (and the draft's steps) from the static buffers as eager, then the
engine: greedy output equals Hugging Face's with every proposer, alone and in batches, when EOS, a stop string or
max_tokens falls inside an accepted run; sampling keeps the model's distribution (a chi-square test at a fixed level,
on fixed seeds, so that it cannot flake); a rejected run gives its blocks back and the prefix cache never holds a
rejected token; the cost policy measures the step at start-up and guesses nothing where rows are dear."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import STEP_COSTS, make_engine, stage
from .scheduling import SilentDetokenizer, finish_step
from .stages import stages_having
from .steps import verification_step

FOLDER = "08_speculative"
speculative = stage(FOLDER, "speculative")
policy = stage(FOLDER, "policy")
proposer = stage(FOLDER, "proposer")
sampler = stage(FOLDER, "sampler")
sequence = stage(FOLDER, "sequence")
scheduler_module = stage(FOLDER, "scheduler")
block_manager_module = stage(FOLDER, "block_manager")

# The chi-square tests' level: a correct implementation fails one seed in a thousand, and the seeds are fixed.
ALPHA = 1e-3


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs`` (categories with expected count 0 must have count 0)."""
    expected = probs.double() * counts.sum()
    assert torch.all(counts[expected == 0] == 0), "a token the distribution never gives was drawn"
    keep = expected > 0
    statistic = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum()
    degrees = int(keep.sum()) - 1
    # The chi-square survival function: the regularized upper incomplete gamma function Q(df / 2, x / 2).
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2))


# --- the n-gram matcher --------------------------------------------------------------------------------------


@pytest.mark.exercise("8.1")
@pytest.mark.parametrize(("tokens", "k", "expected"), [
    ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),  # "1 2 3" occurred before: what followed it
    ([1, 2, 3, 4, 9, 1, 2, 3], 8, [4, 9, 1, 2, 3]),  # fewer than k tokens follow the match: all of them
    ([5, 6, 7, 5, 6, 8, 5, 6], 2, [8, 5]),  # two matches of "5 6": the most recent wins
    ([1, 2, 3, 8, 2, 3, 7, 3, 1, 2, 3], 2, [8, 2]),  # the longest suffix that recurs ("1 2 3"), not "2 3"
    ([1, 2, 3, 4, 5], 3, []),  # nothing recurs
    ([4, 4], 2, []),  # a single repeated token is below n_min = 2
    ([7, 8, 7, 8, 7, 8], 4, [7, 8]),  # a repeated pattern continues (the match may overlap the suffix)
    ([1], 3, []),
], ids=str)
def test_the_ngram_matcher_proposes_what_followed_the_latest_longest_match(tokens, k, expected):
    assert proposer.ngram_propose(tokens, k, n_max=4, n_min=2) == expected


@pytest.mark.exercise("8.1")
def test_the_ngram_matcher_respects_n_max_and_n_min():
    tokens = [1, 2, 3, 4, 5, 0, 9, 3, 4, 5, 6, 2, 3, 4, 5]  # "2 3 4 5" recurs at 1, "3 4 5" later at 7
    assert proposer.ngram_propose(tokens, 1, n_max=4, n_min=2) == [0]  # the longest match: "2 3 4 5" -> 0
    assert proposer.ngram_propose(tokens, 1, n_max=3, n_min=2) == [6]  # "3 4 5": its latest occurrence -> 6
    assert proposer.ngram_propose([3, 1, 2, 3], 2, n_max=4, n_min=1) == [1, 2]  # one token is enough at n_min 1
    assert proposer.ngram_propose([3, 1, 2, 3], 2, n_max=4, n_min=2) == []


@pytest.mark.parametrize(("n_max", "n_min"), [(4, 2), (3, 1), (2, 2)])
def test_the_ngram_index_proposes_exactly_what_the_matcher_finds_as_tokens_arrive(n_max, n_min):
    """The proposer's incremental index against ``ngram_propose`` (the reference), on 300 random histories over 3
    tokens (matches everywhere, overlapping ones too): a proposal after the prompt and after every run of 1 to 5
    appended tokens, whose first token differs from the first guess where there was one (a rejected guess, which
    never enters the history)."""
    rng = random.Random(f"{n_max}-{n_min}")
    ngrams = proposer.NgramProposer(n_max, n_min)
    for trial in range(300):
        seq = decoding(f"s{trial}", rng.randint(1, 6), 0, k=4)
        seq.prompt_ids = [rng.randrange(3) for _ in seq.prompt_ids]
        for _ in range(12):
            k = rng.randint(1, 5)
            [proposal] = ngrams.propose([seq], [k])
            assert proposal.token_ids == proposer.ngram_propose(seq.token_ids, k, n_max, n_min), seq.token_ids
            assert seq.ngram_index.length == seq.num_tokens - 1, "every token but the last indexed, once"
            run = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            if proposal.token_ids:
                run[0] = (proposal.token_ids[0] + 1) % 3
            seq.output_ids += run


# --- the acceptance rules --------------------------------------------------------------------------------------


@pytest.mark.exercise("8.2")
@pytest.mark.parametrize(("draft", "choices", "expected"), [
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all accepted: the bonus token too
    ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the second guess is wrong: the model's token replaces it, then stop
    ([5, 6, 7], [4, 6, 7, 8], [4]),  # the first is wrong: one token, as a plain decode step
    ([], [3], [3]),  # no guesses: a plain decode step
], ids=str)
def test_greedy_acceptance_keeps_the_guesses_up_to_the_first_mismatch_then_the_models_token(draft, choices, expected):
    assert speculative.accept_greedy(draft, choices) == expected


def random_distributions(rows: int, vocab: int, seed: int, zeros: int = 1) -> torch.Tensor:
    """``rows`` distributions over ``vocab`` tokens, each with ``zeros`` tokens of probability 0."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=generator, dtype=torch.float64) + 0.05
    for row in range(rows):
        probs[row, torch.randperm(vocab, generator=generator)[:zeros]] = 0.0
    return (probs / probs.sum(-1, keepdim=True)).float()


@pytest.mark.exercise("8.3")
@pytest.mark.parametrize("with_q", [True, False], ids=["draft-model", "one-hot"])
def test_rejection_sampling_emits_exactly_the_models_distribution(with_q):
    """Whatever the proposer's q, the first emitted token has distribution p[0]; given that the first guess was
    accepted, the second has p[1] (the model's distribution after that guess). 20,000 seeded draws each."""
    vocab, draws = 6, 20_000
    p = random_distributions(3, vocab, seed=1)  # [k + 1, V]
    q = random_distributions(2, vocab, seed=2) if with_q else None  # [k, V], unlike p
    generator = torch.Generator().manual_seed(3)
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(draws):
        # The draft draws its guesses from q (n-gram: fixed guesses, q one-hot).
        draft = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(2)] if with_q else [2, 4]
        emitted = speculative.accept_sampled(draft, p, q, generator)
        assert 1 <= len(emitted) <= 3 and emitted[:-1] == draft[: len(emitted) - 1]
        first[emitted[0]] += 1
        if len(emitted) > 1:  # the first guess was accepted
            second[emitted[1]] += 1
    assert chi_square_p_value(first, p[0]) > ALPHA
    assert chi_square_p_value(second, p[1]) > ALPHA
    assert second.sum() > 1_000, "too few accepted first guesses for the second test"


@pytest.mark.exercise("8.3")
def test_rejection_sampling_accepts_a_guess_the_model_agrees_with_and_never_one_it_rules_out():
    generator = torch.Generator().manual_seed(0)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # p: token 1, then 2, then 0
    assert speculative.accept_sampled([1, 2], certain, None, generator) == [1, 2, 0]  # both, and the bonus
    assert speculative.accept_sampled([2, 2], certain, None, generator) == [1]  # p(2) = 0: rejected, residual
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
    assert speculative.accept_sampled([1, 2], certain, q, generator) == [1, 2, 0]  # p >= q at both: accepted


def test_the_acceptance_rate_follows_verifications_and_drifts_back_to_the_prior_without_guesses():
    spec = speculative.Speculation(4)
    assert spec.acceptance == speculative.PRIOR_ACCEPTANCE
    for _ in range(20):
        spec.record(proposed=4, accepted=0)  # the first guess missed: one guess tested, none kept
    assert spec.acceptance < 0.01
    spec.record(proposed=4, accepted=2)  # two kept, the third missed (the fourth was never tested): 2 of 3
    assert spec.acceptance == pytest.approx(0.25 * 2 / 3, abs=0.01)
    written_off = spec.acceptance
    for _ in range(30):
        spec.record(proposed=0, accepted=0)  # steps without guesses
    assert written_off < spec.acceptance < speculative.PRIOR_ACCEPTANCE, "it drifts back, and is tried again"
    for _ in range(50):
        spec.record(proposed=4, accepted=4)
    assert spec.acceptance > 0.99


# --- the policy: how many guesses pay ---------------------------------------------------------------------------

# Decode steps of SmolLM2-135M, float32, on the course's 2-core CPU (results/cpu/07_cuda_graphs_decode_steps.json,
# the bucket sizes), and on an H100 replaying graphs (results/cuda/07_cuda_graphs_decode_steps.json, bfloat16).
CPU = policy.StepCost(((1, 0.062), (2, 0.097), (4, 0.100), (8, 0.102), (16, 0.126), (32, 0.187), (64, 0.306)))
GPU = policy.StepCost(((1, 0.0034), (8, 0.0038), (16, 0.0041), (32, 0.0048), (64, 0.0060)))
CPU_COST = policy.SpeculationCost(CPU, CPU)
GPU_COST = policy.SpeculationCost(GPU, GPU)


def throughput(acceptance, ks, rows, cost) -> float:
    """Expected tokens per second of a step whose sequences guess ``ks``."""
    tokens = len(ks) + sum(a**j for a, k in zip(acceptance, ks, strict=True) for j in range(1, k + 1))
    return tokens / (cost.verify.seconds(rows + sum(ks)) if any(ks) else cost.decode.seconds(rows))


def test_step_cost_is_straight_lines_between_the_measured_points():
    cost = policy.StepCost(((2, 0.1), (4, 0.2), (8, 0.2)))
    assert [cost.seconds(r) for r in (2, 3, 4, 6, 8)] == pytest.approx([0.1, 0.15, 0.2, 0.2, 0.2])
    assert cost.seconds(1) == 0.1, "below the first point: the first point's cost"
    assert policy.StepCost(((1, 0.1), (3, 0.3))).seconds(5) == pytest.approx(0.5), "past the last: the last line"
    assert policy.StepCost(((1, 0.3), (3, 0.2))).seconds(9) == 0.2, "never falling past the last point"
    assert policy.StepCost(((4, 0.1),)).seconds(40) == 0.1
    with pytest.raises(AssertionError):
        policy.StepCost(((4, 0.1), (2, 0.2)))


def test_measure_step_cost_times_each_row_count_after_an_untimed_run():
    calls = []
    cost = policy.measure_step_cost(calls.append, [4, 1, 4], repeats=3)
    assert calls == [1, 4] * 4  # once untimed, then three rounds
    assert [r for r, _ in cost.points] == [1, 4] and all(s >= 0 for _, s in cost.points)


def test_no_guesses_when_rows_are_dear_and_guesses_are_seldom_kept():
    assert policy.plan_guesses([0.2] * 64, [4] * 64, 64, CPU_COST) == [0] * 64
    assert policy.plan_guesses([0.5] * 64, [4] * 64, 64, CPU_COST) == [0] * 64


def test_every_guess_at_batch_1_when_guesses_are_mostly_kept():
    assert policy.plan_guesses([0.9], [4], 1, CPU_COST) == [4]
    assert policy.plan_guesses([0.9], [2], 1, CPU_COST) == [2], "never more than the cap"
    assert policy.plan_guesses([0.0], [4], 1, CPU_COST) == [0], "guesses never kept are never worth a row"


def test_a_flat_step_cost_pays_for_guesses_at_large_batches():
    """On a GPU a row costs almost nothing: even at 64 sequences, guesses kept half the time pay; but not when a step
    with guesses cannot replay a graph and costs 20 ms instead of 6 (as in this stage)."""
    assert policy.plan_guesses([0.5] * 64, [4] * 64, 64, GPU_COST) == [1] * 64  # a**2 = 0.25 is not worth its row
    assert policy.plan_guesses([0.8] * 64, [4] * 64, 64, GPU_COST) == [2] * 64
    eager = policy.SpeculationCost(policy.StepCost(((1, 0.020), (64, 0.0215), (320, 0.025))), GPU)
    assert policy.plan_guesses([0.8] * 64, [4] * 64, 64, eager) == [0] * 64


def test_what_a_guessing_sequence_adds_beyond_its_rows_keeps_lone_guesses_out_of_large_batches():
    """On a CPU each sequence with guesses adds its own attention call per layer (a few ms): one guess each for 64
    sequences then costs far more than 64 rows. The step's cost with guesses holds one such sequence already, so at
    most that one still guesses."""
    per_sequence = policy.SpeculationCost(CPU, CPU, per_sequence=0.006)
    assert sum(map(bool, policy.plan_guesses([0.8] * 64, [4] * 64, 64, CPU_COST))) > 1, "rows alone: many pay at 64"
    assert sum(map(bool, policy.plan_guesses([0.8] * 64, [4] * 64, 64, per_sequence))) <= 1
    assert policy.plan_guesses([0.9], [4], 1, per_sequence) == [4], "one sequence alone: its guesses still pay"


def test_a_dear_draft_model_pays_for_fewer_guesses():
    draft = policy.StepCost(((1, 0.030), (64, 0.100)))  # a third of the model's steps
    free = policy.plan_guesses([0.7], [4], 1, CPU_COST)
    drafted = policy.plan_guesses([0.7], [4], 1, policy.SpeculationCost(CPU, CPU, draft))
    assert free == [4] and drafted[0] < 4
    assert policy.plan_guesses([0.95], [4], 1, policy.SpeculationCost(CPU, CPU, CPU)) == [0], \
        "a draft as dear as the model: each guess costs a whole step"


@settings(max_examples=200, deadline=None)
@given(plan=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 8)), min_size=1, max_size=48),
       prompt_rows=st.integers(0, 64), gpu=st.booleans())
def test_a_plan_never_passes_its_caps_never_favours_a_lower_rate_and_never_loses_throughput(plan, prompt_rows, gpu):
    acceptance, caps = [a for a, _ in plan], [cap for _, cap in plan]
    cost, rows = GPU_COST if gpu else CPU_COST, len(plan) + prompt_rows
    ks = policy.plan_guesses(acceptance, caps, rows, cost)
    assert all(0 <= k <= cap for k, cap in zip(ks, caps, strict=True))
    for i, j in [(i, j) for i in range(len(plan)) for j in range(len(plan)) if acceptance[i] > acceptance[j]]:
        assert ks[i] >= min(ks[j], caps[i]), "a higher acceptance rate got fewer guesses"
    assert throughput(acceptance, ks, rows, cost) >= throughput(acceptance, [0] * len(ks), rows, cost) * (1 - 1e-9)


# --- the scheduler's room for guesses ---------------------------------------------------------------------------


def decoding(name: str, prompt_len: int, outputs: int, k: int, max_tokens: int = 1000):
    params = sampler.SamplingParams(max_tokens=max_tokens)
    seq = sequence.Sequence(name, list(range(prompt_len)), params, generator=None, detokenizer=None,
                            speculation=speculative.Speculation(k))
    seq.output_ids = list(range(outputs))
    return seq


def admitted(scheduler, *seqs) -> None:
    """Put ``seqs`` in the running queue with their whole context computed but the last token, as after a step."""
    for seq in seqs:
        scheduler.block_manager.allocate(seq.block_table, [], seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.status = sequence.SequenceStatus.RUNNING
        scheduler.running.append(seq)


@pytest.mark.exercise("8.4")
def test_each_decode_gets_room_for_its_guesses_within_the_budget_and_its_max_tokens():
    blocks = block_manager_module.BlockManager(100, block_size=16)
    scheduler = scheduler_module.Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=12, eos_token_ids=set())
    a, b = decoding("a", 15, 1, k=4), decoding("b", 20, 0, k=4)
    c = decoding("c", 30, 5, k=4, max_tokens=8)  # 3 tokens to go: 2 guesses + 1 of the model's
    admitted(scheduler, a, b, c)
    batch = scheduler.schedule()  # 3 decodes, then 9 tokens of budget for guesses: 4 + 4 + 1 (c's max: 2)
    assert [s.num_scheduled_tokens for s in batch.seqs] == [5, 5, 2]
    assert [s.num_lookahead_slots for s in batch.seqs] == [4, 4, 1]
    assert len(a.block_table) == 2, "a's guesses reach positions 16 to 19: a second block"
    assert batch.num_tokens == 12


@pytest.mark.exercise("8.4")
def test_guesses_never_preempt_anyone_and_the_policy_decides_who_guesses():
    blocks = block_manager_module.BlockManager(7, block_size=16)
    scheduler = scheduler_module.Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=set(),
                                           cost=CPU_COST)
    # Each one's last token ends a block (a: 1 block, b: 2, c: 3): guesses need a new block, and one is free.
    a, b, c = decoding("a", 16, 0, k=4), decoding("b", 32, 0, k=4), decoding("c", 48, 0, k=4)
    admitted(scheduler, a, b, c)
    a.speculation.acceptance, b.speculation.acceptance, c.speculation.acceptance = 0.9, 0.0, 0.9
    batch = scheduler.schedule()
    # a's guesses take the free block; b's are never kept, so the policy gives it none; c's guesses find no block:
    # c decodes one token, nobody is preempted for a guess.
    assert [s.num_scheduled_tokens for s in batch.seqs] == [5, 1, 1]
    assert [len(s.block_table) for s in batch.seqs] == [2, 2, 3]
    assert blocks.num_free == 0 and scheduler.num_preemptions == 0


def test_room_for_guesses_the_proposer_cannot_fill_counts_as_a_miss_and_stops_being_reserved():
    """A sequence whose text never recurs: the n-gram proposer returns nothing for it. Under a CPU's cost its first
    steps get room (the prior says its guesses are worth it); each empty proposal counts as a rejected guess, so
    after two misses the policy gives it no room for the next steps, until the drift back to the prior makes its
    guesses worth a try again (some ten steps later, then less and less often). Counted as a step without guesses,
    the miss would leave its rate at the prior, and room would be reserved (and the proposer called) at every step."""
    blocks = block_manager_module.BlockManager(100, block_size=16)
    scheduler = scheduler_module.Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=set(),
                                           cost=CPU_COST)
    seq = decoding("open chat", 20, 1, k=4)
    seq.detokenizer = SilentDetokenizer()
    admitted(scheduler, seq)
    room = []
    for step in range(20):
        batch = scheduler.schedule()
        room.append(seq.num_lookahead_slots)
        if seq.num_lookahead_slots:
            scheduler.set_guesses([seq], [speculative.Proposal([])])
        assert seq.num_scheduled_tokens == 1, "no guess: its last token alone"
        finish_step(scheduler, batch, [scheduler_module.Sampled([100 + step], [None])])
        assert seq.num_lookahead_slots == 0, "the room lasts one step"
    assert room[0] == 4 and not any(room[2:8]) and sum(map(bool, room)) <= 4, room  # [4, 4, 0 x 8, 4, 0 ...]
    assert seq.speculation.acceptance < speculative.PRIOR_ACCEPTANCE


def test_shrink_gives_back_the_blocks_past_the_accepted_tokens_newest_first():
    blocks = block_manager_module.BlockManager(10, block_size=4)
    table: list[int] = []
    blocks.allocate(table, [], 13)  # 4 blocks
    held = list(table)
    blocks.shrink(table, 6)
    assert table == held[:2] and list(blocks.free_blocks)[-2:] == [held[3], held[2]]
    blocks.shrink(table, 8)  # nothing past 8 tokens: nothing to give back
    assert table == held[:2]


# --- the engine, on the course's model ------------------------------------------------------------------------

# A prompt whose answer repeats it: the n-gram proposer has plenty to guess from.
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
EXTRACTIVE = f"Repeat this code exactly:\n{CODE}"


def chat(engine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


def run_to_the_end(engine) -> dict[str, list]:
    """Step until every request is done; each request's outputs, in order."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for output in engine.step().outputs:
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


@pytest.mark.exercise("8.5")
def test_eos_and_max_tokens_inside_an_accepted_run_cut_exactly_there(model_dir, hf_greedy):
    """The model as its own draft guesses every greedy token right, so each step emits k + 1 = 5 tokens: the
    first token comes from the prefill, then runs of 5. An answer of 8 tokens ends (EOS) inside its second
    run. max_tokens is never overrun: with 2 tokens to go, a step guesses 1."""
    engine = make_engine(FOLDER, model_dir, kv_cache_mb=16, speculative="draft", draft_model=str(model_dir),
                         num_speculative_tokens=4, speculative_policy="always")
    prompt = chat(engine, "What is the capital of France?")
    expected = hf_greedy(prompt, 32)
    assert expected[-1] in engine.eos_token_ids and len(expected) % 5 != 1, "the answer no longer ends mid-run"
    engine.add_request("eos", prompt, sampler.SamplingParams(max_tokens=32, temperature=0.0))
    engine.add_request("cut", prompt, sampler.SamplingParams(max_tokens=3, temperature=0.0, logprobs=1))
    outputs = run_to_the_end(engine)
    eos, cut = outputs["eos"], outputs["cut"]
    assert [t for o in eos for t in o.token_ids] == expected and eos[-1].finish_reason == "stop"
    assert [len(o.token_ids) for o in eos[:-1]] == [1] + [5] * (len(eos) - 2), "every guess should be accepted"
    assert [t for o in cut for t in o.token_ids] == expected[:3] and cut[-1].finish_reason == "length"
    assert [len(o.token_ids) for o in cut] == [1, 2] and cut[-1].completion_tokens == 3
    assert all(len(o.logprobs) == len(o.token_ids) for o in cut), "a logprob for every emitted token"
    assert engine.block_manager.num_used == 0


@pytest.fixture(scope="module")
def ngram(model_dir):
    return make_engine(FOLDER, model_dir, kv_cache_mb=64, speculative="ngram", num_speculative_tokens=4,
                       speculative_policy="always")  # the tests below need guesses at every step, whatever they cost


def test_ngram_guesses_give_hugging_faces_tokens_and_rejected_guesses_give_their_blocks_back(ngram, hf_greedy):
    """A request alone, step by step: the same tokens as Hugging Face, guesses both kept and rejected, and after
    every step no block beyond the next token's slot. Then a follow-up that starts with the whole answer finds
    its blocks in the prefix cache (computed while guesses were being rejected) and continues as Hugging Face."""
    prompt = chat(ngram, EXTRACTIVE)
    before = ngram.stats().speculation
    ngram.add_request("alone", prompt, sampler.SamplingParams(max_tokens=40, temperature=0.0))
    [seq] = ngram.scheduler.sequences["alone"]
    tokens = []
    while ngram.has_unfinished():
        tokens += [t for output in ngram.step().outputs for t in output.token_ids]
        if ngram.has_unfinished():
            assert len(seq.block_table) <= ngram.block_manager.blocks_needed(seq.num_computed_tokens + 1)
    assert tokens == hf_greedy(prompt, 40)
    after = ngram.stats().speculation
    accepted, proposed = after.accepted - before.accepted, after.proposed - before.proposed
    assert 0 < accepted < proposed, "the run should see guesses accepted and guesses rejected"
    follow_up = prompt + tokens
    hits = ngram.scheduler.prefix_cache_hits
    [more] = ngram.generate_offline([follow_up], sampler.SamplingParams(max_tokens=8, temperature=0.0))
    assert ngram.scheduler.prefix_cache_hits - hits == (len(follow_up) - 1) // 16 * 16
    assert more == hf_greedy(follow_up, 8)


@pytest.mark.exercise("8.5")
def test_a_stop_string_inside_an_accepted_run_ends_the_text_and_the_tokens_there(ngram, hf_greedy):
    prompt = chat(ngram, EXTRACTIVE)
    expected = hf_greedy(prompt, 40)
    text = ngram.tokenizer.decode(expected)
    stop = "\n\ndef"  # completed by the 4th token of a run of 5 accepted tokens (" b\n\ndef sub")
    ngram.add_request("stop", prompt, sampler.SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))
    outputs = run_to_the_end(ngram)["stop"]
    assert "".join(o.text for o in outputs) == text[: text.index(stop)]
    tokens = [t for output in outputs for t in output.token_ids]
    assert tokens == expected[: len(tokens)] and stop in ngram.tokenizer.decode(tokens)
    assert outputs[-1].finish_reason == "stop" and len(outputs[-1].token_ids) > 1, "the stop fell inside a run"
    assert ngram.block_manager.num_used == 0


def test_seeded_sampling_without_guesses_draws_what_stage_07_draws(ngram, engine07):
    """A step without guesses samples with stage 07's exponential race, from the same stream; a seed reproduces
    an answer with guesses too."""
    prompt = chat(ngram, "Write a haiku about the sea.")
    params = sampler.SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    off = make_engine(FOLDER, ngram.config.model, kv_cache_mb=16, speculative="off")
    theirs = engine07.generate_offline([prompt], stage("07_cuda_graphs", "sampler").SamplingParams(**vars(params)))
    assert off.generate_offline([prompt], params) == theirs
    extractive = chat(ngram, EXTRACTIVE)
    params = sampler.SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    assert ngram.generate_offline([extractive], params) == ngram.generate_offline([extractive], params)


def test_the_server_streams_runs_and_reports_its_guesses(server08, hf_greedy):
    """Through the OpenAI client: a streamed chat answer whose chunks carry whole runs is Hugging Face's answer, and
    /metrics and /health count the guesses (the server's engine: n-gram, k = 4)."""
    import httpx

    client = server08.client()
    accepted = server08.metric("llm_spec_accepted_tokens_total")
    engine = server08.engine._engine
    # The cost policy, with a CPU's costs rather than those measured at start-up (a busy machine can make guesses
    # look dear): at batch 1 a sequence with the prior acceptance rate guesses.
    measured, engine.scheduler.cost = engine.scheduler.cost, CPU_COST
    assert measured is not None, "the engine measures its steps at start-up"
    try:
        stream = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=40, temperature=0,
                                                stream=True, messages=[{"role": "user", "content": EXTRACTIVE}])
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    finally:
        engine.scheduler.cost = measured
    assert text == engine.tokenizer.decode(hf_greedy(chat(engine, EXTRACTIVE), 40), skip_special_tokens=True)
    assert server08.metric("llm_spec_accepted_tokens_total") > accepted
    assert server08.metric("llm_spec_proposed_tokens_total") >= server08.metric("llm_spec_accepted_tokens_total")
    speculation = httpx.get(f"{server08.url}/health", timeout=10).json()["speculation"]
    assert speculation["accepted"] > 0 and 0 < speculation["acceptance_rate"] <= 1
    assert speculation["mean_accepted_length"] == speculation["accepted"] / speculation["runs"]


# --- sampling keeps the model's distribution, on a tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(model_dir, tmp_path_factory):
    """A tiny random Llama (2 layers, a vocabulary of 256) with the course model's tokenizer, and its Hugging Face
    twin: thousands of sampled tokens take seconds."""
    from .test_model import copy_tokenizer, save_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny_speculative")
    hf_model = save_tiny_checkpoint("llama", folder)
    copy_tokenizer(model_dir, folder)
    return folder, hf_model


def test_speculative_sampling_has_the_models_distribution(tiny):
    """1,600 seeded samples of an answer's first two tokens (top-k 3, temperature 1): the second comes through a
    one-layer draft's guess and rejection sampling. Against the exact distribution of the Hugging Face model,
    p(t1) p(t2 | t1) over the 9 pairs, chi-square at level ALPHA."""
    folder, hf_model = tiny
    engine = make_engine(FOLDER, folder, kv_cache_mb=16, speculative="draft", draft_layers=1,
                         num_speculative_tokens=1, max_num_seqs=128, speculative_policy="always")
    prompt = list(range(40, 52))
    top_k, samples = 3, 1600
    params = [sampler.SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True, seed=i)
              for i in range(samples)]
    answers = engine.generate_offline([prompt] * samples, params)
    # Nearly every second token comes through a guess (a few sequences are still catching the draft up).
    assert engine.stats().speculation.proposed >= 0.9 * samples, "the second tokens should come through guesses"
    assert 0 < engine.stats().speculation.accepted < samples, "the draft's q should differ from the model's p"

    def top(ids: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
        values, tokens = torch.topk(logits, top_k)
        return dict(zip(tokens.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    exact = {(a, b): pa * pb for a, pa in top(prompt).items() for b, pb in top(prompt + [a]).items()}
    pairs = list(exact)
    counts = torch.zeros(len(pairs), dtype=torch.float64)
    for answer in answers:
        counts[pairs.index(tuple(answer[:2]))] += 1
    assert chi_square_p_value(counts, torch.tensor([exact[pair] for pair in pairs])) > ALPHA


def test_a_draft_model_that_does_not_fit_is_refused_at_start_up(model_dir, tiny):
    folder, _ = tiny  # the course model's tokenizer, but 256 logits per row
    with pytest.raises(ValueError, match="256 logits per row"):
        make_engine(FOLDER, model_dir, kv_cache_mb=16, speculative="draft", draft_model=str(folder))
    with pytest.raises(ValueError, match="draft-layers 31"):
        make_engine(FOLDER, model_dir, kv_cache_mb=16, speculative="draft", draft_layers=31)


# --- steps with guesses from the static buffers ------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("folder", stages_having("speculation"))
def test_a_step_with_guesses_runs_from_the_static_buffers_as_it_runs_eagerly(folder, attention, tiny, monkeypatch):
    """Sequences with 2, 0, 1 and 4 guesses (11 rows) run in the verification bucket of 16 rows (K = 4: at most 5
    a sequence): the same logits as the eager step, finite padding rows, and no K/V written outside the step's own
    slots (padding writes nothing). With the PyTorch attention, and with the Triton kernels that CUDA captures
    (interpreted on a CPU): one padding sequence per padding row, then empty ones, the grid fixed at 5 rows a
    sequence. A step of one row a sequence keeps its decode bucket; a sequence with more rows than 1 + K (a prompt
    chunk) makes the step eager."""
    engine = make_engine(folder, tiny[0], kv_cache_mb=16, max_num_seqs=8, speculative="ngram",
                         num_speculative_tokens=4, speculative_policy="always")
    monkeypatch.setenv("LLM_ATTENTION", attention)
    runner, cache, runner_module = engine.runner, engine.kv_cache, stage(folder, "model_runner")
    seqs = [(37, 2, [1, 2, 3]), (16, 0, [4, 5]), (5, 1, [6]), (80, 4, [7, 8, 9, 10, 11, 12])]
    step = verification_step(runner_module, seqs)
    assert runner.bucket(step) == runner_module.Bucket(16, 5)
    assert runner.verify_sizes == [2, 4, 5, 8, 10, 16, 20, 32, 40], "the decode sizes, and each times 5 rows"
    assert runner.buckets[0] == (40, 5), "8 sequences x 5 rows"
    assert runner.buffers.input_ids.shape[0] == 40, "the buffers hold the largest bucket, the capture's first"
    assert runner.bucket(verification_step(runner_module, [(s[0], 0, s[2]) for s in seqs])) == (4, 1)
    assert runner.bucket(verification_step(runner_module, [(37, 5, [1, 2, 3])])) is None
    torch.manual_seed(0)
    cache.data.normal_()  # K/V to attend to, in every block
    before = cache.data.clone()
    calls = []
    run_static = runner.run_static
    runner.run_static = lambda *args: calls.append(args[1]) or run_static(*args)
    static, _ = runner.execute(step)
    assert calls == [(16, 5)], "the step took the static path"
    assert torch.isfinite(runner.buffers.hidden[:16]).all(), "padding rows stay finite"
    written = torch.zeros(cache.num_blocks * 16, dtype=torch.bool)
    written[step.slot_mapping] = True
    for layer in range(cache.shape.num_layers):
        for pool, old in zip(cache.layer(layer), (before[0, layer], before[1, layer]), strict=True):
            assert torch.equal(pool.flatten(0, 1)[~written], old.flatten(0, 1)[~written]), "padding wrote K/V"
    eager, _ = runner.run_eager(step)
    assert static.shape == eager.shape == (11, 256)
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("folder", stages_having("speculation"))
def test_verification_steps_take_the_static_path_in_the_engine_and_keep_its_greedy_tokens(folder, tiny):
    """Prompts that repeat themselves, n-gram guesses at every step: the steps with guesses run from the static
    buffers (the verification buckets), and the greedy answers are those of the engine without speculation."""
    prompts = [[40 + i, 101, 102, 103, 104] * 3 for i in range(5)]
    params = sampler.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = make_engine(folder, tiny[0], kv_cache_mb=16, speculative="off").generate_offline(prompts, params)
    engine = make_engine(folder, tiny[0], kv_cache_mb=16, max_num_seqs=8, speculative="ngram",
                         num_speculative_tokens=4, speculative_policy="always")
    buckets = []
    run_static = engine.runner.run_static
    engine.runner.run_static = lambda *args: buckets.append(args[1]) or run_static(*args)
    assert engine.generate_offline(prompts, params) == plain
    assert engine.stats().speculation.proposed > 0
    assert any(bucket.query_len == 5 for bucket in buckets), "steps with guesses ran from the static buffers"


@pytest.mark.parametrize("folder", stages_having("speculation"))
def test_the_draft_runner_captures_its_decode_buckets_and_its_one_token_steps_run_static(folder, tiny, monkeypatch):
    """Where graphs are captured (CUDA, Triton, not --enforce-eager; pretended here), the draft model's runner
    captures its buckets too, and not under --enforce-eager. Its one-token steps run from its static buffers, and
    give the guesses its eager steps give: the same guesses proposed and accepted, the same answers."""
    runner_module, proposer_module = stage(folder, "model_runner"), stage(folder, "proposer")
    captured = []
    monkeypatch.setattr(proposer_module, "captures_graphs", lambda device, enforce_eager: not enforce_eager)
    monkeypatch.setattr(runner_module.ModelRunner, "capture", lambda runner: captured.append(runner))
    config = dict(kv_cache_mb=16, max_num_seqs=8, speculative="draft", draft_layers=1, num_speculative_tokens=3,
                  speculative_policy="always")
    make_engine(folder, tiny[0], enforce_eager=True, **config)
    assert captured == [], "--enforce-eager captures nothing"
    engine = make_engine(folder, tiny[0], **config)
    assert captured == [engine.proposer.runner], "the draft's runner, and only it (the target's: no CUDA here)"
    prompts = [[40 + i, 101, 102, 103] * 2 for i in range(4)]
    params = sampler.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    buckets = []
    run_static = engine.proposer.runner.run_static
    engine.proposer.runner.run_static = lambda *args: buckets.append(args[1]) or run_static(*args)
    answers, stats = engine.generate_offline(prompts, params), engine.stats().speculation
    assert buckets and all(bucket.query_len == 1 for bucket in buckets), "the draft's decode steps ran static"
    eager = make_engine(folder, tiny[0], enforce_eager=True, **config)
    eager.proposer.runner.bucket = lambda step: None  # every draft step eager
    assert eager.generate_offline(prompts, params) == answers
    assert (eager.stats().speculation.proposed, eager.stats().speculation.accepted) == (stats.proposed,
                                                                                         stats.accepted)


# --- the cost policy in the engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", stages_having("speculation"))
def test_the_engine_measures_its_steps_and_guesses_nothing_where_rows_are_dear(folder, tiny):
    """At start-up the engine times decode steps of a few batch sizes, and steps with guesses (the same line, shifted
    by the price of the verification attention); the policy weighs guesses against that cost.
    64 sequences whose prompts repeat themselves (n-gram lookup guesses from the first step) under a CPU's cost, where
    a row is dear at that batch: no guess. The same requests with every guess made (policy "always") do guess."""
    tiny_folder, _ = tiny
    engine = make_engine(folder, tiny_folder, kv_cache_mb=16, max_num_seqs=64, max_num_batched_tokens=1024,
                         step_costs="")  # timed here (other tests' engines read the committed STEP_COSTS)
    measured = engine.scheduler.cost
    rows = stage(folder, "model_runner").cost_rows(64)
    assert [r for r, _ in measured.decode.points] == rows and all(s > 0 for _, s in measured.decode.points)
    shifts = [v - d for (_, v), (_, d) in zip(measured.verify.points, measured.decode.points, strict=True)]
    assert [r for r, _ in measured.verify.points] == rows and measured.draft is None
    assert min(shifts) >= 0 and max(shifts) - min(shifts) < 1e-9, "one price for verification, at every size"
    prompts = [[40 + i % 50, 101, 102, 103] * 3 for i in range(64)]
    params = sampler.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.scheduler.cost = stage(folder, "policy").SpeculationCost(CPU, CPU)
    engine.generate_offline(prompts, params)
    assert engine.stats().speculation.proposed == 0
    engine.scheduler.cost = None
    engine.generate_offline(prompts, params)
    assert engine.stats().speculation.proposed > 0
    always = make_engine(folder, tiny_folder, kv_cache_mb=16, speculative_policy="always")
    assert always.scheduler.cost is None and always.runner.step_cost is None, "nothing to measure"


@pytest.mark.parametrize("folder", stages_having("speculation"))
def test_step_costs_from_a_step_bench_file_replace_the_timing(folder, tiny):
    """--step-costs: the policy weighs guesses against a step_bench file's decode steps (a step with guesses costs a
    decode step of as many rows there), and nothing is timed at start-up."""
    policy = stage(folder, "policy")
    runner = stage(folder, "model_runner").ModelRunner
    timed = []
    measure = runner.measure_cost
    runner.measure_cost = lambda self, *args, **kwargs: timed.append(args) or measure(self, *args, **kwargs)
    try:
        engine = make_engine(folder, tiny[0], kv_cache_mb=16, step_costs=str(STEP_COSTS))
    finally:
        runner.measure_cost = measure
    cost = policy.fixed_cost(STEP_COSTS, replayed=False)
    assert timed == [] and engine.scheduler.cost == policy.SpeculationCost(cost.verify, cost.decode, None, 0.0)
    steps = json.loads(STEP_COSTS.read_text())["steps"]
    assert cost.decode.seconds(1) == next(s["static_ms"] for s in steps if s["batch_size"] == 1) / 1000


@pytest.mark.parametrize("folder", stages_having("speculation"))
def test_the_draft_proposer_reads_its_guesses_back_once_per_proposal(folder, tiny):
    """k draft steps per proposal, and the CPU waits for the device once: each step's tokens are the last step's
    guesses, sent on as a device tensor, and the guesses of every sequence are read back together at the end. (A
    read per guess is k waits, each stopping the CPU from queueing the next draft step.) Greedy, no penalties:
    nothing else is read, nothing copied with a wait, no list indexes a tensor."""
    from .syncs import count_syncs

    engine = make_engine(folder, tiny[0], kv_cache_mb=16, max_num_seqs=8, speculative="draft", draft_layers=1,
                         num_speculative_tokens=3, speculative_policy="always")
    propose, seen = engine.proposer.propose, []

    def counted(seqs, ks):
        with count_syncs() as syncs:
            proposals = propose(seqs, ks)
        seen.append((syncs, sum(len(p.token_ids) for p in proposals)))
        return proposals

    engine.proposer.propose = counted
    # The draft's forward pass stubbed (on a CPU its attention reads tensors the GPU kernels never would): logits
    # that make every guess 7, then 8, then 9 (garbage the model rejects, as any draft's guesses may be).
    vocab, calls = engine.proposer.model.config.vocab_size, []

    def execute(step, input_ids=None):
        calls.append(step)
        logits = torch.zeros(len(step.logits_indices), vocab)
        logits[:, 7 + len(calls) % 3] = 1.0
        return logits, None

    engine.proposer.runner.execute = execute
    prompts = [[40 + i, 101, 102, 103] * 2 for i in range(4)]
    engine.generate_offline(prompts, stage(folder, "sampler").SamplingParams(max_tokens=8, temperature=0.0,
                                                                               ignore_eos=True))
    assert any(guesses > len(prompts) for _, guesses in seen), "several guesses a sequence in some proposal"
    for syncs, guesses in seen:
        assert syncs.reads == (1 if guesses else 0), syncs.calls
        assert not syncs.copies and not syncs.list_indexing, syncs.calls
