"""Steps built by hand for a model runner, shared by the CPU tests and the GPU tests (which must import nothing but
torch and the stages: see test_cuda.py)."""

from __future__ import annotations


def verification_step(runner_module, seqs: list[tuple[int, int, list[int]]], block_size: int = 16):
    """A step of sequences with (tokens cached, guesses k, block table) ``seqs``: each runs 1 + k rows after its
    cache, writes their K/V, and every row is scored (its last token's and its guesses')."""
    step = runner_module.StepInput([], [], [], [0], [], [], [], [], [])
    for i, (cached, k, table) in enumerate(seqs):
        end = cached + 1 + k
        step.input_ids += [(31 * i + 7 * j) % 250 for j in range(1 + k)]
        step.positions += range(cached, end)
        step.slot_mapping += runner_module.token_slots(table, block_size, cached, end)
        step.query_start_loc.append(step.query_start_loc[-1] + 1 + k)
        step.seq_lens.append(end)
        step.block_tables.append(list(table))
        step.logits_indices += range(step.query_start_loc[-2], step.query_start_loc[-1])
        step.num_prompt_logits.append(0)
    return step
