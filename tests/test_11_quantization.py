"""Stage 11: quantized weights. The linear layers kept in int4 blocks of 32 (the GGUF's own Q4_1 blocks) or int8 per
row, multiplied by torch's quantized kernels.

The formats first, against what they stand for (exercises 11.1 and 11.2), each kernel against the float product of
its dequantized weights, the blocks of one rank's slice; then the engine: its greedy tokens against Hugging Face's
on the same dequantized weights (the fake-quantized reference), its weights' bytes and the pool that gets what they
freed, and /health. (Every server and API test of the stages before runs for this stage in the every-stage tests,
unquantized: ``engine_config`` asks for ``quantization="none"`` unless a test gives another.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import torch

from common.gguf_blocks import BLOCK, Blocks, read_blocks
from common.weights import source_gguf

from .conftest import make_engine, serve_stage, stage
from .prompts import CHAT_PROMPTS, TEXT_PROMPTS

FOLDER = "11_quantization"
quantize = stage(FOLDER, "quantize")
parallel = stage(FOLDER, "parallel")
sampler = stage(FOLDER, "sampler")

MAX_TOKENS = 32
# The quantized kernels take bfloat16 activations and return bfloat16: every linear layer's input and output is
# rounded as a bfloat16 model's are, so a greedy flip is accepted where Hugging Face (on the same dequantized weights,
# in float32) gives the two tokens logprobs within this margin (the bfloat16 rule of test_all_stages, vLLM's
# check_logprobs_close), and the comparison stops there. Measured on the standard prompts: 3 of 6 answers flip in each
# mode, at gaps of 0.004 to 0.05 nats.
MARGIN = 0.5


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


# --- the formats ---------------------------------------------------------------------------------------------


@pytest.mark.exercise("11.1")
def test_int8_codes_are_the_nearest_for_each_rows_scale():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    w[5, 7] = 40.0  # an outlier: its row's scale, no other row's
    q = quantize.Int8Weight.from_float(w)
    assert q.codes.dtype == torch.int8 and q.scale.dtype == torch.bfloat16 and q.scale.shape == (64,)
    scale = q.scale.float()
    assert torch.equal(scale, bf16(w.abs().amax(dim=1) / 127)), "one scale per row: its largest weight maps to 127"
    assert q.codes.abs().max() <= 127
    # Each code the nearest for the scale the kernel uses (the bfloat16 one), within rounding's half step.
    error = (w - q.codes.float() * scale[:, None]).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(q.dequantize(), q.codes.float() * scale[:, None])


@pytest.fixture(scope="module")
def course_blocks(model_dir: Path) -> dict[str, Blocks]:
    gguf = source_gguf(model_dir)
    if gguf is None:
        pytest.skip(f"{model_dir} has no GGUF to read blocks from (the course model has one)")
    return read_blocks(gguf)


@pytest.mark.exercise("11.2")
def test_int4_weights_are_the_files_q4_1_blocks(course_blocks):
    """Q4_1's d * q + m is torch's (q - 8) * s + z with s = d, z = m + 8 d: the file's weights, with the scale and
    zero rounded to bfloat16 (the kernel's), and nothing else."""
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        blocks = course_blocks[name]
        weight = quantize.Int4Weight(blocks, torch.float32).dequantize()  # [out, in]
        out, cols = blocks.codes.shape
        codes = blocks.codes.float().reshape(out, cols // BLOCK, BLOCK)
        scale, zero = bf16(blocks.scale), bf16(blocks.minimum + 8 * blocks.scale)
        expected = ((codes - 8) * scale[..., None] + zero[..., None]).reshape(out, cols)
        assert torch.equal(weight, expected), name
        # Against the file's own numbers: bfloat16's rounding of the scale (|q - 8| <= 8 of it) and of the zero.
        bound = (8 * blocks.scale.abs() + (blocks.minimum + 8 * blocks.scale).abs()) * 2**-8
        assert ((weight - blocks.dequantize()).abs().reshape(out, -1, BLOCK) <= bound[..., None]).all(), name


@pytest.mark.parametrize("rows", [1, 7, 64, 100])
def test_each_kernel_computes_its_dequantized_weights_product(rows):
    torch.manual_seed(rows)
    w = torch.randn(192, 128) * 0.05
    x = torch.randn(rows, 128)
    bias = torch.randn(192)
    for q in (quantize.Int8Weight.from_float(w), quantize.Int4Weight(quantize.q4_1_blocks(w), torch.float32)):
        expected = bf16(x) @ q.dequantize().t() + bias  # the kernels read bfloat16 input
        got = q.linear(x, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, 192)
        # Within the bfloat16 rounding of the output (and, many-rows int8, of nothing: float32 throughout).
        assert torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item()), type(q).__name__


@pytest.mark.exercise("11.4")
def test_the_int8_kernel_takes_the_steps_of_few_rows_and_float_the_rest():
    """Fewer than KERNEL_ROWS rows on a CPU: the int8 kernel's bits exactly; from KERNEL_ROWS on, or off the CPU,
    the widened float product's."""
    torch.manual_seed(3)
    q = quantize.Int8Weight.from_float(torch.randn(48, 640))
    few, many = quantize.Int8Weight.KERNEL_ROWS - 1, quantize.Int8Weight.KERNEL_ROWS
    assert q.uses_kernel(torch.empty(1, 640)) and q.uses_kernel(torch.empty(few, 640))
    assert not q.uses_kernel(torch.empty(many, 640))
    assert q.uses_kernel(torch.empty(2, 4 * many))  # the rows count, not the features
    assert not q.uses_kernel(torch.empty(1, 640, device="meta"))  # a device that is not a CPU: widened
    for rows, kernel in ((few, True), (many, False)):
        x = torch.randn(rows, 640)
        expected = (torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q.codes, q.scale).float() if kernel
                    else torch.nn.functional.linear(x, q.codes.float() * q.scale.float()[:, None]))
        assert torch.equal(q.linear(x), expected), rows


@pytest.mark.exercise("11.3")
def test_q4_1_blocks_of_a_float_weight_put_each_weight_on_the_nearest_step():
    torch.manual_seed(1)
    w = torch.randn(32, 128)
    blocks = quantize.q4_1_blocks(w)
    assert blocks.codes.max() <= 15 and blocks.codes.min() >= 0
    error = (blocks.dequantize() - w).abs().reshape(32, -1, BLOCK)
    assert (error <= blocks.scale[..., None] / 2 * (1 + 1e-5)).all()
    # Each group's extremes are exactly two of its steps: the minimum (code 0) and the maximum (code 15).
    assert torch.equal(blocks.codes.reshape(32, -1, BLOCK).amin(-1), torch.zeros(32, 4, dtype=torch.uint8))


def test_a_ranks_blocks_are_its_slice_of_the_weight():
    torch.manual_seed(2)
    blocks = quantize.q4_1_blocks(torch.randn(64, 256))
    full = blocks.dequantize()
    rows, columns = parallel.Shard(0, 16, 48), parallel.Shard(1, 64, 192)
    assert torch.equal(quantize.shard_blocks(blocks, rows).dequantize(), full[16:48])
    assert torch.equal(quantize.shard_blocks(blocks, columns).dequantize(), full[:, 64:192])
    with pytest.raises(AssertionError, match="cuts a block"):
        quantize.shard_blocks(blocks, parallel.Shard(1, 16, 128))
    stacked = quantize.stack_blocks([quantize.shard_blocks(blocks, rows), blocks])
    assert torch.equal(stacked.dequantize(), torch.cat([full[16:48], full]))


def test_auto_quantizes_a_model_that_ships_in_blocks_and_leaves_a_float_one(model_dir, tmp_path):
    if source_gguf(model_dir) is not None:
        assert quantize.pick_quantization("auto", model_dir) == "int4"
    assert quantize.pick_quantization("auto", tmp_path) == "none"  # no GGUF: a float checkpoint stays float
    (tmp_path / "model.Q4_1.gguf").touch()  # a local folder with its quantized original beside it
    assert source_gguf(tmp_path) == (tmp_path / "model.Q4_1.gguf").resolve()
    assert quantize.pick_quantization("auto", tmp_path) == "int4"
    (tmp_path / "other.gguf").touch()  # two: which one is the model's is not for us to guess
    assert source_gguf(tmp_path) is None
    assert quantize.pick_quantization("int8", tmp_path) == "int8"
    with pytest.raises(ValueError, match="--quantization 'int3'"):
        quantize.pick_quantization("int3", tmp_path)


# --- the engine ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request, model_dir):
    """An engine of this stage in one mode, and Hugging Face's model loaded with its dequantized weights."""
    from transformers import AutoModelForCausalLM

    engine = make_engine(FOLDER, model_dir, quantization=request.param, kv_cache_mb=0)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    weights = engine.model.dequantized_weights()
    result = reference.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys[:3]
    yield request.param, engine, reference, weights
    engine.shutdown()


def test_greedy_tokens_are_hugging_faces_on_the_same_dequantized_weights(quantized, references):
    mode, engine, reference, weights = quantized
    digest = hashlib.sha256(b"".join(weights[name].numpy().tobytes() for name in sorted(weights))).hexdigest()[:16]
    greedy = references(f"greedy-{mode}-{digest}")  # kept on disk for these exact weights

    def theirs(ids: list[int]) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            return reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                                      do_sample=False)[0, len(ids):].tolist()

    prompts = [engine.encode(p) for p in TEXT_PROMPTS]
    prompts += [engine.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    ours = engine.generate_offline(prompts, sampler.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for ids, tokens in zip(prompts, ours, strict=True):
        expected = greedy.get(f"{MAX_TOKENS}:{','.join(map(str, ids))}", lambda ids=ids: theirs(ids))
        flip = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None)
        if flip is None:
            assert tokens == expected, engine.tokenizer.decode(ids)
            continue
        with torch.inference_mode():
            logprobs = reference(torch.tensor([ids + expected[:flip]])).logits[0, -1].log_softmax(-1)
        gap = abs(float(logprobs[tokens[flip]] - logprobs[expected[flip]]))
        assert gap <= MARGIN, f"{mode}, token {flip} of {engine.tokenizer.decode(ids)!r}: a flip {gap:.2g} nats apart"


def test_the_weights_take_a_fraction_of_their_bytes_and_the_pool_gets_the_rest(quantized):
    mode, engine, _, _ = quantized
    memory = engine.stats().memory
    assert memory.quantization == mode
    most = {"int4": 0.25, "int8": 0.3}[mode]  # of float32's: int4 at half a byte, int8 at one, plus their scales
    assert memory.weight_bytes <= most * memory.unquantized_weight_bytes, memory
    freed = memory.unquantized_weight_bytes - memory.weight_bytes
    block = engine.kv_cache.shape.bytes_per_block
    assert memory.kv_cache_bytes == (stage(FOLDER, "kv_cache").CPU_DEFAULT_MB * 2**20 + freed) // block * block


def test_health_shows_the_weights_and_the_pool(quantized):
    mode, engine, _, _ = quantized
    with serve_stage(FOLDER, engine) as live:
        health = httpx.get(f"{live.url}/health", timeout=30).json()
    assert health["memory"]["quantization"] == mode
    assert health["memory"]["kv_cache_bytes"] == engine.kv_cache.num_bytes
    assert health["memory"]["weight_bytes"] == engine.model.num_weight_bytes


@pytest.mark.cuda
def test_the_int4_kernel_on_a_gpu_computes_its_dequantized_weights_product():
    torch.manual_seed(0)
    w = torch.randn(192, 128, device="cuda") * 0.05
    q = quantize.Int4Weight(quantize.q4_1_blocks(w.cpu()).to("cuda"), torch.bfloat16)
    x = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ q.dequantize().t()
    assert torch.allclose(q.linear(x).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
