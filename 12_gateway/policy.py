"""The speculation policy: how many guesses each decoding sequence gets in a step, 0 included, so that guessing pays.

A guess is worth the tokens it adds to the step, and costs the time its row adds to the step. On a GPU a step
costs about the same from 1 row to a few hundred, so guesses are nearly free even at large batches. On a CPU a
step's time grows with its rows (SmolLM2-135M on this course's 2 cores: about 57 ms + 4 ms a row): at 64
sequences, four guesses each turn 64 rows into 320 and the step takes four times as long, for far fewer than four
times the tokens. So before each step the policy weighs, for every decoding sequence:

* what a step costs, by its number of rows (``StepCost``, measured at start-up by ``model_runner.start_runner``);
* the sequence's acceptance rate a, the chance that one of its guesses is kept (``speculative.Speculation``).

Its j-th guess counts only if the j - 1 before it were kept too, so it adds a**j tokens on average.
``plan_guesses`` takes every sequence's guesses in order of that value and keeps as many as give the most tokens
per second. ``python -m 08_speculative.policy`` prints, for a few acceptance rates, the largest batch at which
guessing still pays on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepCost:
    """Seconds of one forward pass by its number of rows: measured points, and straight lines between them.

    Below the first point a step costs what the first point does; past the last, the line through the last two
    goes on (on a CPU the cost grows linearly with the rows there; it is never taken to fall)."""

    points: tuple[tuple[int, float], ...]  # (rows, seconds), rows increasing

    def __post_init__(self) -> None:
        rows = [r for r, _ in self.points]
        assert rows and rows == sorted(set(rows)), f"rows must increase: {rows}"

    def seconds(self, rows: int) -> float:
        points = self.points
        if rows <= points[0][0] or len(points) == 1:
            return points[0][1]
        i = bisect_left(points, (rows,))  # the first point at or past ``rows``
        if i == len(points):  # past the last point: the last segment goes on, never downwards
            (r0, s0), (r1, s1) = points[-2:]
            return s1 + max(0.0, (s1 - s0) / (r1 - r0)) * (rows - r1)
        (r0, s0), (r1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)


def measure_step_cost(run: Callable[[int], None], rows: list[int], repeats: int) -> StepCost:
    """Time ``run(r)`` for each r of ``rows``: once untimed (a new shape may allocate or compile), then the best of
    ``repeats`` runs, taken in rounds over every r (a moment when the machine is busy elsewhere spoils one round, not
    all the runs of one r)."""
    rows = sorted(set(rows))
    for r in rows:
        run(r)
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(repeats):
        for r in rows:
            start = time.perf_counter()
            run(r)
            best[r] = min(best[r], time.perf_counter() - start)
    return StepCost(tuple(best.items()))


@dataclass(frozen=True)
class SpeculationCost:
    """What the policy weighs guesses against: a step with guesses, a step without, and a draft model's steps.

    The first two differ by their attention: a step with guesses runs in a verification bucket, whose extend kernel
    (on a CPU, a call of its own for the sequence with guesses) replaces the decode kernel; on CUDA both replay a
    captured graph."""

    verify: StepCost  # a step whose decodes bring guesses, by its rows (the decodes and all the guesses)
    decode: StepCost  # a step without guesses, by its rows (one per decoding sequence)
    draft: StepCost | None = None  # one step of a draft model, by its rows (one per sequence still guessing)
    # Seconds each sequence that guesses adds beyond its rows, after the first (``verify``'s steps hold one): on a CPU
    # the attention of its 1 + k rows is a call of its own, layer by layer (a decode row's is shared with the others').
    per_sequence: float = 0.0
    # Seconds a step with guesses loses by not overlapping (its proposer needs the last token on the host, so it
    # waits for the step before): the host's work of a step, which an overlapped step hides behind the device's
    # (``Engine.measure_host``; 0 on a CPU, whose steps compute as they are launched and hide nothing).
    sync: float = 0.0


def plan_guesses(acceptance: list[float], caps: list[int], rows: int, cost: SpeculationCost) -> list[int]:
    """How many guesses each decoding sequence gets this step (at most ``caps[i]``): the plan that emits the most
    tokens per second, by expectation.

    Without guesses the step emits T = len(acceptance) tokens, one per sequence, in decode(rows) seconds. The j-th
    guess of a sequence with acceptance rate a adds a**j tokens and one row (with a draft model, also a row of the
    draft's j-th step); the first guess of every guessing sequence but one also adds ``cost.per_sequence``, and any
    guess at all adds ``cost.sync`` (a step with guesses cannot overlap the one before it). Taking
    the guesses in decreasing a**j, keep the first n that make (T + their a**j) / seconds the largest, n = 0
    included. With a cost linear in rows that is adding guesses while a**j / (seconds a row) beats T / seconds;
    trying every n also handles a cost that is not linear (the draft's first row at a depth pays for its whole step;
    on a CPU two rows may cost far more than one, and five little more than two)."""
    guesses = sorted(((a**j, j, a, i) for i, (a, cap) in enumerate(zip(acceptance, caps, strict=True))
                      for j in range(1, cap + 1)), key=lambda g: (-g[0], g[1], -g[2]))
    tokens = float(len(acceptance))
    best, best_rate = 0, tokens / cost.decode.seconds(rows)
    draft_seconds, depth = 0.0, [0] * (max(caps, default=0) + 1)  # depth[j]: sequences in the draft's j-th step
    for n, (value, j, _, _) in enumerate(guesses, 1):
        tokens += value
        if j == 1 and n > 1:  # another sequence's first guess (a sequence's comes before its second: a > a**2)
            draft_seconds += cost.per_sequence
        if cost.draft is not None:
            draft_seconds += cost.draft.seconds(depth[j] + 1) - (cost.draft.seconds(depth[j]) if depth[j] else 0.0)
            depth[j] += 1
        rate = tokens / (cost.verify.seconds(rows + n) + draft_seconds + cost.sync)
        if rate > best_rate:
            best, best_rate = n, rate
    ks = [0] * len(acceptance)
    for *_, i in guesses[:best]:
        ks[i] += 1
    return ks


# --- where guessing stops paying ---------------------------------------------------------------------------------


def largest_paying_batch(cost: SpeculationCost, rate: float, k: int, most: int) -> int:
    """The largest batch, up to ``most`` sequences, at which a step of sequences that all have acceptance ``rate``
    still gets a guess from the policy (0: not even one sequence alone)."""
    return max((b for b in range(1, most + 1) if any(plan_guesses([rate] * b, [k] * b, b, cost))), default=0)


def costs_from_results(path: Path) -> dict[str, SpeculationCost]:
    """The policy's costs from a ``step_bench`` result file (``NN_name_decode_steps.json``): its decode steps at
    the bucket sizes (the sizes the engine measures), eager and from the static buffers, a step with guesses taken
    to cost a decode step of as many rows. With CUDA graphs, two: steps with guesses replayed, as this stage runs
    them, and run eagerly (every kernel launched from Python: what capturing them saves); without, one (both are
    the same pass)."""
    steps = [s for s in json.loads(path.read_text())["steps"] if s["batch_size"] == s["bucket"]]
    static = StepCost(tuple((s["batch_size"], s["static_ms"] / 1000) for s in steps))
    if not any(s["graphs"] for s in steps):
        return {"measured": SpeculationCost(static, static)}
    eager = StepCost(tuple((s["batch_size"], s["eager_ms"] / 1000) for s in steps))
    return {"guesses eager": SpeculationCost(eager, static), "guesses replayed": SpeculationCost(static, static)}


def fixed_cost(path: Path, replayed: bool) -> SpeculationCost:
    """The costs of a ``step_bench`` result file that an engine runs by: with CUDA graphs, its steps with guesses
    ``replayed`` from the static buffers or run eagerly; without, the one measured cost."""
    costs = costs_from_results(path)
    return costs.get("measured") or costs["guesses replayed" if replayed else "guesses eager"]


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.policy",
                                     description="the largest batch at which guessing still pays")
    parser.add_argument("--device", default="cpu", help="measure this device's step cost, as the engine does")
    parser.add_argument("--results", type=Path, help="instead, the decode steps of a step_bench "
                        "result file (NN_name_decode_steps.json)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k: the most guesses a sequence")
    parser.add_argument("--most", type=int, default=256, help="the largest batch to try")
    args = parser.parse_args()
    if args.results:
        costs = costs_from_results(args.results)
    else:
        from .config import EngineConfig
        from .engine import Engine

        engine = Engine(EngineConfig(device=args.device, num_speculative_tokens=args.num_speculative_tokens))
        costs = {f"measured ({engine.device.type})": engine.scheduler.cost}
    rates, k = (0.2, 0.5, 0.8), args.num_speculative_tokens
    print(f"A step's time by rows (without guesses / with), and the largest batch at which its sequences still get "
          f"guesses (k = {k}), by acceptance rate a:")
    print(f"{'':20}{'1 row':>16}{'16 rows':>16}{'64 rows':>16}" + "".join(f"{f'a = {rate}':>10}" for rate in rates))
    for name, cost in costs.items():
        times = [f"{1000 * cost.decode.seconds(r):.0f} / {1000 * cost.verify.seconds(r):.0f} ms" for r in (1, 16, 64)]
        batches = [largest_paying_batch(cost, rate, k, args.most) for rate in rates]
        print(f"{name:20}" + "".join(f"{t:>16}" for t in times)
              + "".join(f"{b if b < args.most else f'>= {b}':>10}" for b in batches))
        print(f"{'':20}each sequence with guesses adds {1000 * cost.per_sequence:.1f} ms beyond its rows")


if __name__ == "__main__":
    main()
