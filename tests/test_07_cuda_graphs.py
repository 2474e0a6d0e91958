"""Stage 07: a decode step runs from static buffers, padded to a bucket (and, on CUDA, replays a captured graph).

The buckets cover every batch size; padding rows write no K/V and attend to nothing; the buffers hold
exactly the current step (ragged block tables padded in one tensor operation, the logits' rows loaded with
it); the static path gives the eager path's logits at every batch size, and it leaves every block outside
the batch untouched. On CUDA (``pytest -m cuda``): capture, and replay
equal to eager, also when a sequence's block table grows between replays."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from .conftest import make_engine, stage
from .stages import stages_having
from .test_attention import dense_attention, paged_case

FOLDER = "07_cuda_graphs"
model_runner = stage(FOLDER, "model_runner")
attention = stage(FOLDER, "attention")


def decode_step(rows: list[tuple[int, list[int]]], block_size: int = 16):
    """A decode step whose sequences have (context length, block table) ``rows``; each writes its new token's
    K/V into the last position of its context. The tables as ``prepare`` gives them: each as long as it is."""
    seq_lens = [length for length, _ in rows]
    slots = [table[(length - 1) // block_size] * block_size + (length - 1) % block_size for length, table in rows]
    return model_runner.StepInput(
        input_ids=[(7 * i + 3) % 1000 for i in range(len(rows))], positions=[length - 1 for length in seq_lens],
        slot_mapping=slots, query_start_loc=list(range(len(rows) + 1)), seq_lens=seq_lens,
        block_tables=[list(table) for _, table in rows],
        logits_indices=list(range(len(rows))), prompt_logits_indices=[], num_prompt_logits=[0] * len(rows))


# --- which bucket ------------------------------------------------------------------------------------------


@pytest.mark.exercise("7.1")
@pytest.mark.parametrize("max_num_seqs", [1, 7, 16, 50, 64, 512])
def test_every_batch_size_gets_the_smallest_bucket_that_holds_it(max_num_seqs):
    sizes = model_runner.graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_num_seqs
    assert set(sizes) <= {1, 2, 4, 8, max_num_seqs} | set(range(16, max_num_seqs, 16))  # few graphs to capture
    for n in range(1, max_num_seqs + 1):
        bucket = model_runner.bucket_for(n, sizes)
        assert bucket == min(size for size in sizes if size >= n), n
    assert model_runner.bucket_for(max_num_seqs + 1, sizes) is None  # too many rows: the step runs eagerly


@pytest.mark.exercise("7.1")
def test_the_buckets_are_powers_of_two_then_every_16():
    assert model_runner.graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert model_runner.graph_batch_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]  # 49 and 50 need a bucket too


# --- padding rows do nothing ---------------------------------------------------------------------------------


@pytest.mark.exercise("7.2")
@pytest.mark.parametrize("seq_lens", [[37, 0, 0], [0, 0], [0, 600, 5, 0]], ids=str)
def test_a_padding_row_attends_to_nothing_and_gives_zeros(seq_lens):
    real = [length or 1 for length in seq_lens]  # the dense references need at least one key
    q, k_cache, v_cache, tables, _, dense = paged_case(7, real, 16, num_kv_heads=3, group=3, head_dim=32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = attention.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale=1 / math.sqrt(32))
    for i, (length, (k, v)) in enumerate(zip(seq_lens, dense, strict=True)):
        if length == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), f"padding row {i} is not zero"
        else:
            torch.testing.assert_close(out[i], dense_attention(q[i : i + 1], k, v, causal=False)[0], atol=1e-4,
                                       rtol=0)


@pytest.mark.exercise("7.2")
def test_rows_of_length_0_are_in_no_group():
    lens = torch.tensor([0, 40, 0, 900, 3], dtype=torch.int32)
    groups = attention.length_groups(lens)
    assert sorted(torch.cat(groups).tolist()) == [1, 3, 4]
    assert attention.length_groups(torch.zeros(4, dtype=torch.int32)) == []



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_the_triton_decode_kernel_gives_zeros_for_padding_rows(device, num_splits):
    """Under TRITON_INTERPRET=1 on a CPU, compiled on a GPU: a row of context length 0 has no key in any split,
    and the merge of the splits must give 0 for it, not 0 / 0."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernels = stage(FOLDER, "triton_attention")
    q, k_cache, v_cache, tables, _, _ = paged_case(5, [37, 1, 200, 1], 16, num_kv_heads=3, group=3, head_dim=32)
    lens = torch.tensor([37, 0, 200, 0], dtype=torch.int32)  # rows 1 and 3: padding
    scale = 1 / math.sqrt(32)
    expected = attention.decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    out = kernels.decode_attention(*[t.to(device) for t in (q, k_cache, v_cache, tables, lens)], scale,
                                   num_splits=num_splits).cpu()
    assert torch.isfinite(out).all()
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)

def test_write_kv_skips_slot_minus_1_and_leaves_the_last_slot_alone():
    k_cache = torch.full((4, 16, 2, 8), 7.0)
    v_cache = torch.full((4, 16, 2, 8), 7.0)
    k, v = torch.ones(4, 2, 8), torch.ones(4, 2, 8)
    attention.write_kv(k, v, k_cache, v_cache, torch.tensor([-1, 5, -1, 9]))
    written = torch.zeros(64, dtype=torch.bool)
    written[[5, 9]] = True
    for cache in (k_cache, v_cache):
        flat = cache.view(64, 2, 8)
        assert torch.equal(flat[written], torch.ones(2, 2, 8))
        assert torch.equal(flat[~written], torch.full((62, 2, 8), 7.0))  # slot 63 too: -1 is not "the last"


# --- the static buffers --------------------------------------------------------------------------------------


@pytest.mark.exercise("7.3")
def test_load_pads_to_the_bucket_and_keeps_nothing_of_the_previous_step():
    buffers = model_runner.StaticBuffers.allocate(8, 4, hidden_size=6, dtype=torch.float32,
                                                  device=torch.device("cpu"))
    buffers.load(decode_step([(20, [3, 5]), (3, [1]), (49, [2, 4, 6, 7])]), size=4)
    assert buffers.input_ids[:4].tolist() == [3, 10, 17, 0]
    assert buffers.positions[:4].tolist() == [19, 2, 48, 0]
    assert buffers.slot_mapping[:4].tolist() == [5 * 16 + 3, 1 * 16 + 2, 7 * 16 + 0, -1]
    assert buffers.seq_lens[:4].tolist() == [20, 3, 49, 0]
    assert buffers.block_tables[:4].tolist() == [[3, 5, 0, 0], [1, 0, 0, 0], [2, 4, 6, 7], [0, 0, 0, 0]]
    buffers.load(decode_step([(17, [9, 8])]), size=2)  # a smaller step: its rows, then padding, nothing stale
    assert buffers.input_ids[:2].tolist() == [3, 0]
    assert buffers.slot_mapping[:2].tolist() == [8 * 16 + 0, -1]
    assert buffers.seq_lens[:2].tolist() == [17, 0]
    assert buffers.block_tables[:2].tolist() == [[9, 8, 0, 0], [0, 0, 0, 0]]
    meta = buffers.metadata(2)
    assert meta.block_tables.data_ptr() == buffers.block_tables.data_ptr()  # views: a graph sees every step
    assert meta.max_query_len == 1 and meta.query_lens.tolist() == [1, 1]


@pytest.mark.parametrize("folder", stages_having("static_buffers"))
def test_ragged_tables_and_the_logits_rows_load_with_the_step_and_leave_nothing_stale(folder):
    """``prepare`` gives each sequence's table as long as it is; ``load`` pads them with block 0 to the buffers' width
    in one tensor operation: the buffers hold exactly what padding each row in Python gave, and a narrow table
    after a wide one in the same row leaves nothing of it. The rows whose logits the step needs go in with the
    step's other numbers (before the pass: no tensor is made from a list after it), so ``execute`` indexes a view."""
    runner_module = stage(folder, "model_runner")
    buffers = runner_module.StaticBuffers.allocate(8, 6, hidden_size=6, dtype=torch.float32,
                                                   device=torch.device("cpu"))
    step = decode_step([(49, [2, 4, 6, 7]), (3, [1]), (20, [3, 5])])
    buffers.load(replace(step, logits_indices=[0, 2]), size=4)  # row 1: a chunk that ends mid-prompt
    assert buffers.block_tables[:4].tolist() == [[2, 4, 6, 7, 0, 0], [1, 0, 0, 0, 0, 0], [3, 5, 0, 0, 0, 0],
                                                 [0] * 6]
    assert buffers.logits_indices[:2].tolist() == [0, 2]
    buffers.load(decode_step([(3, [9]), (40, [8, 10, 11])]), size=2)  # narrower where it was wide, and the reverse
    assert buffers.block_tables[:2].tolist() == [[9, 0, 0, 0, 0, 0], [8, 10, 11, 0, 0, 0]]
    assert buffers.logits_indices[:2].tolist() == [0, 1]
    assert buffers.block_tables.dtype == torch.int32 and buffers.seq_lens[:2].tolist() == [3, 40]


@pytest.mark.exercise("7.3")
def test_a_table_wider_than_the_buffers_is_refused():
    buffers = model_runner.StaticBuffers.allocate(4, 2, hidden_size=6, dtype=torch.float32,
                                                  device=torch.device("cpu"))
    with pytest.raises(ValueError, match="wider"):
        buffers.load(decode_step([(40, [1, 2, 3])]), size=1)


# --- the runner, on the embedded model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_dir):
    """A small pool of its own: the sentinel test writes into every block."""
    return make_engine(FOLDER, model_dir, kv_cache_mb=40, max_num_seqs=16)  # 55 blocks


def real_rows(engine, n: int) -> list[tuple[int, list[int]]]:
    """n sequences of different lengths, each on blocks of its own (block 0 is left out: padding reads it)."""
    rows, next_block = [], 1
    for i in range(n):
        length = 3 + 5 * i
        blocks = -(-length // 16)
        rows.append((length, list(range(next_block, next_block + blocks))))
        next_block += blocks
    assert next_block <= engine.kv_cache.num_blocks
    return rows


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 8, 9, 16])
def test_the_static_path_gives_the_eager_paths_logits(engine, batch_size):
    runner = engine.runner
    step = decode_step(real_rows(engine, batch_size))  # ragged tables: run_eager pads them too
    bucket = runner.bucket(step)
    assert bucket == model_runner.bucket_for(batch_size, runner.sizes)
    eager, _ = runner.run_eager(step)
    static, prompt_logits = runner.execute(step)
    assert prompt_logits is None and static.shape == eager.shape
    if bucket == batch_size:  # no padding: the same operators on the same shapes, the same numbers
        assert torch.equal(static, eager)
    else:
        # Padding rows change the matrix products' row count, and on a CPU that can change how a row is summed
        # (another kernel, other blocks; below 16 rows the transposed product of matmul.py, from 16 on F.linear):
        # its last bits, amplified over 30 layers to a few 1e-3 of logits of size 10 or so (3.8e-3 seen between
        # 9 rows and their bucket of 16). Float32 rounding, not a wrong row: both kernels are within 2e-6 of a
        # float64 product.
        torch.testing.assert_close(static, eager, atol=1e-2, rtol=1e-5)


def test_padded_steps_leave_every_block_outside_the_batch_untouched(engine):
    runner, cache = engine.runner, engine.kv_cache
    rows = real_rows(engine, 3)  # bucket 4: one padding row
    ours = {block for _, table in rows for block in table}
    for layer in range(cache.shape.num_layers):
        for pool in cache.layer(layer):
            pool.fill_(1234.5)
    runner.execute(decode_step(rows))
    for layer in range(cache.shape.num_layers):
        for pool in cache.layer(layer):
            others = [block for block in range(cache.num_blocks) if block not in ours]
            assert torch.all(pool[others] == 1234.5), f"layer {layer}: padding wrote outside the batch"
            written = [table[(length - 1) // 16] for length, table in rows]
            assert not torch.all(pool[written] == 1234.5)  # the real rows did write


@pytest.mark.cuda
def test_graph_replay_equals_eager_and_follows_a_growing_block_table(model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    engine = make_engine(FOLDER, model_dir, device="cuda", kv_cache_mb=64, max_num_seqs=16)
    runner = engine.runner
    assert sorted(runner.graphs) == runner.sizes and engine.runner.capture_seconds is not None
    assert engine.runner.graph_memory_bytes > 0, "the graphs' pool holds the largest bucket's activations"
    for batch_size in (1, 3, 8, 13):
        step = decode_step(real_rows(engine, batch_size))
        replayed, _ = runner.execute(step)
        eager, _ = runner.run_eager(step)
        assert torch.isfinite(runner.buffers.hidden[: runner.bucket(step)]).all()  # padding rows too
        torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)  # bf16
    # The same sequence, one block longer at the next replay: the graph reads the table from the buffer.
    for length in (16, 17, 33):
        table = list(range(1, 1 + -(-length // 16)))
        step = decode_step([(length, table)])
        replayed, _ = runner.execute(step)
        eager, _ = runner.run_eager(step)
        torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
