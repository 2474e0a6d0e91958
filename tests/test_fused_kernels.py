"""Fused kernels (stage 07 on, ``fused.py``): residual add + RMSNorm, SiLU-and-multiply, and rotary embedding with
the K/V write, each one Triton kernel, against its PyTorch reference; the CPU path is the code the model ran before.

Each kernel test runs on the CPU, the kernel under TRITON_INTERPRET=1, and on a GPU (marked ``cuda``), over head
sizes 64, 128 (and 80, padded inside the kernel), 1 to 8 query heads per KV head, float32 and bfloat16, odd row
counts and padding rows (slot -1: nothing written, the pool's last slot included). Then, on a tiny random model:
the CPU path gives stage 06's numbers bit for bit; the kernels inside the model give the reference's logits and
K/V, padding rows included; a decode step launches 10 kernels a layer, counted from the code (every PyTorch
operator that is not a view, every Triton launch); and on CUDA the fused kernels replay in a captured graph.

Triton's interpreter (3.9) rounds float32 to bfloat16 by truncation where a GPU rounds to nearest, so in
bfloat16 the kernels agree with the reference to a unit in the last place (``torch.testing``'s bfloat16
tolerance); in float32 the interpreter computes the reference's operations in the same order, and agrees to
rounding."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .conftest import stage
from .stages import changed_stages_with

STAGES = changed_stages_with("fused")  # 07 (later stages hold byte-identical copies)
FOLDER = "07_cuda_graphs"
DTYPES = [torch.float32, torch.bfloat16]
SENTINEL = 1234.5


@pytest.fixture(scope="module", params=STAGES)
def fused(request):
    return stage(request.param, "fused")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request, monkeypatch) -> str:
    """Where the kernels run: the CPU through Triton's interpreter, or the GPU, compiled. Either way the entry
    points take the Triton path (``LLM_ATTENTION=triton``), as they do on CUDA by default."""
    if request.param == "cpu" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton compiles for the GPU on this machine: the kernels are tested in the cuda case")
    monkeypatch.setenv("LLM_ATTENTION", "triton")
    return request.param


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 to rounding; bfloat16 to a unit in the last place for each of the (up to three) roundings on the
    way: the residual sum, the norm, its product with the weight (2**-7: a unit relative to the smallest value of
    an exponent)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=3 * 2**-7)


def randn(*shape: int, seed: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(device)


# --- each kernel against its reference ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 576)])  # 576: the course model's, not a power of two
def test_add_rms_norm_kernel_matches_the_reference(fused, device, dtype, rows, hidden):
    """With the residual (the new stream comes back too) and without (the first layer's norm, the final norm)."""
    x = randn(rows, hidden, seed=1, dtype=dtype, device=device, scale=3.0)
    residual = randn(rows, hidden, seed=2, dtype=dtype, device=device, scale=3.0)
    weight = randn(hidden, seed=3, dtype=dtype, device=device, scale=0.1) + 1
    out, stream = fused.add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_stream = fused.add_rms_norm_reference(x, residual, weight, 1e-5)
    assert_close(stream, expected_stream)
    assert_close(out, expected_out)
    assert_close(fused.rms_norm(x, weight, 1e-5), fused.rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [128, 1100])  # 1100: two blocks of features, the second one masked
def test_silu_and_mul_kernel_matches_the_reference(fused, device, dtype, intermediate):
    gate_up = randn(5, 2 * intermediate, seed=intermediate, dtype=dtype, device=device, scale=3.0)
    assert_close(fused.silu_and_mul(gate_up), fused.silu_and_mul_reference(gate_up))


def metadata(attention, slots: list[int], device: str):
    """The one field of a step's metadata the K/V write reads (the rest is attention's)."""
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    return attention.AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=None, query_lens=None,
                                       seq_lens=None, block_tables=None, max_query_len=1, logits_indices=None)


# (head_dim, num_kv_heads, group): the query heads per KV head from 1 to 8; 80 is padded to 128 inside
ROTARY = [(64, 1, 1), (64, 2, 3), (64, 1, 8), (128, 2, 1), (128, 1, 4), (128, 2, 8), (80, 3, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("head_dim", "num_kv_heads", "group"), ROTARY,
                         ids=[f"d{d}-kv{k}-g{g}" for d, k, g in ROTARY])
def test_rotary_and_kv_write_kernel_matches_the_reference(fused, device, dtype, head_dim, num_kv_heads, group):
    """7 rows, 3 of them padding (slot -1), one real row in slot 0: the same rotated queries and the same pools
    as the reference; every slot the step does not name keeps its sentinel, the pool's last one included."""
    attention = stage(fused.__package__, "attention")
    num_heads, num_blocks, block_size = num_kv_heads * group, 3, 4
    slots = [5, -1, 0, 9, -1, 2, -1]
    qkv = randn(len(slots), num_heads + 2 * num_kv_heads, head_dim, seed=head_dim + group, dtype=dtype,
                device=device)
    positions = torch.tensor([40, 0, 3, 1000, 7, 12, 0])
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(positions.float(), inv_freq)  # [T, D/2]; as the model looks them up: [T, 1, D/2]
    cos, sin = angles.cos()[:, None].to(device), angles.sin()[:, None].to(device)
    pools = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, dtype=dtype, device=device)
             for _ in range(4)]  # the kernel's K and V, the reference's K and V
    meta = metadata(attention, slots, device)
    q = fused.rotary_and_write_kv(qkv, cos, sin, pools[0], pools[1], meta, num_heads)
    expected = fused.rotary_and_write_kv_reference(qkv, cos, sin, pools[2], pools[3], meta, num_heads)
    assert_close(q, expected)
    assert_close(pools[0], pools[2])
    assert torch.equal(pools[1], pools[3]), "values are copied, not computed"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[[slot for slot in slots if slot >= 0]] = False
    assert untouched[-1], "the pool's last slot is not the step's: a slot of -1 must not wrap around to it"
    for pool in pools[:2]:
        assert torch.all(pool.flatten(0, 1)[untouched.to(device)] == SENTINEL), "a padding row wrote K/V"


# --- in the model, on a tiny random model ---------------------------------------------------------------------

TINY = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "tie_word_embeddings": True}  # head_dim 32


def tiny_model(folder: str, dtype: torch.dtype, device: str = "cpu", state: dict | None = None):
    model_module = stage(folder, "model")
    torch.manual_seed(0)
    model = model_module.LlamaForCausalLM(model_module.ModelConfig.from_hf(TINY))
    if state is not None:
        model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def two_steps(folder: str, model, device: str = "cpu", padding: bool = True) -> list[torch.Tensor]:
    """A prompt of 18 and one of 5 in one prefill, then a decode step of both, with a padding row (slot -1, context
    0) unless told: the logits of each step, the decode step's hidden states of the two, and the pool after it."""
    attention, kv_cache = stage(folder, "attention"), stage(folder, "kv_cache")
    shape = model.config.cache_shape(16, model.model.embed_tokens.weight.dtype)
    cache = kv_cache.KVCache.allocate(shape, 5 * shape.bytes_per_block, torch.device(device))
    cache.data.fill_(SENTINEL)

    def tensor(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    prefill = attention.AttentionMetadata(
        slot_mapping=tensor([*range(18), *range(32, 37)], torch.int64), query_start_loc=tensor([0, 18, 23]),
        query_lens=tensor([18, 5]), seq_lens=tensor([18, 5]), block_tables=tensor([[0, 1], [2, 0]]),
        max_query_len=18, logits_indices=tensor([17, 22], torch.int64))
    rows = 3 if padding else 2
    decode = attention.AttentionMetadata(
        slot_mapping=tensor([18, 37, -1][:rows], torch.int64), query_start_loc=tensor([0, 1, 2, 3][: rows + 1]),
        query_lens=tensor([1] * rows), seq_lens=tensor([19, 6, 0][:rows]),
        block_tables=tensor([[0, 1], [2, 0], [0, 0]][:rows]), max_query_len=1,
        logits_indices=tensor([0, 1], torch.int64))
    with torch.inference_mode():
        hidden = model(tensor(list(range(100, 123)), torch.int64), tensor([*range(18), *range(5)], torch.int64),
                       cache, prefill)
        logits = [model.compute_logits(hidden[prefill.logits_indices])]
        hidden = model(tensor([5, 6, 0][:rows], torch.int64), tensor([18, 5, 0][:rows], torch.int64), cache, decode)
        logits.append(model.compute_logits(hidden[:2]))
    return [*logits, hidden[:2], cache.data]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cpu_path_gives_stage_06s_numbers_bit_for_bit(dtype, monkeypatch):
    """The references are the operators the model ran before, in the same order: stage 07's model on a CPU gives
    stage 06's logits, hidden states and K/V exactly (its residual stream carried beside each block's output
    changes no sum). Without a padding row, which stage 06's attention does not leave out."""
    monkeypatch.setenv("LLM_ATTENTION", "torch")
    ours = tiny_model(FOLDER, dtype)
    before = tiny_model("06_chunked_prefill", dtype, state=ours.state_dict())
    for new, old in zip(two_steps(FOLDER, ours, padding=False), two_steps("06_chunked_prefill", before, padding=False),
                        strict=True):
        assert torch.equal(new, old)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_in_the_model_give_the_references_logits_and_kv(fused, device, dtype, monkeypatch):
    """A prefill of two prompts, then a decode step with a padding row, through every fused kernel (and the
    attention kernels): the reference's logits and pool, and no K/V outside the steps' slots."""
    folder = fused.__package__
    model = tiny_model(folder, dtype, device)
    kernels = two_steps(folder, model, device)
    monkeypatch.setenv("LLM_ATTENTION", "torch")
    reference = two_steps(folder, model, device)
    written = torch.zeros(5 * 16, dtype=torch.bool, device=device)
    written[[*range(19), *range(32, 38)]] = True
    pools, reference_pools = (pool.flatten(2, 3) for pool in (kernels[3], reference[3]))  # [2, layers, slots, ...]
    assert torch.all(pools[:, :, ~written] == SENTINEL), "K/V written outside the steps' slots"
    for actual, expected in [*zip(kernels[:3], reference[:3], strict=True),
                             (pools[:, :, written], reference_pools[:, :, written])]:
        # bfloat16: a few units in the last place of the largest value (2 ** -7 of it), after two layers
        scale = expected.float().abs().max().item() if dtype == torch.bfloat16 else 0.0
        torch.testing.assert_close(actual.float(), expected.float(), atol=max(1e-4, 2**-5 * scale),
                                   rtol=1e-4 if dtype == torch.float32 else 2**-5)


class KernelCount(TorchDispatchMode):
    """Counts what a CUDA device would launch: every PyTorch operator that is not a view or an allocation, and
    every Triton launch (the operators the interpreter runs inside a launch are not the kernel's)."""

    FREE = {"view", "_unsafe_view", "t", "slice", "unsqueeze", "split", "split_with_sizes", "select", "transpose",
            "expand", "alias", "as_strided", "detach", "empty", "empty_like", "empty_strided", "flatten", "permute",
            "squeeze", "reshape", "_reshape_alias", "lift_fresh", "unbind"}

    def __init__(self, *modules) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.launching = False
        self.modules = modules
        self.kernels = {(module, name): getattr(module, name) for module in modules for name in dir(module)
                        if name.startswith("_") and name.endswith("_kernel")}

    PRODUCTS = {"linear", "mm", "addmm", "matmul"}  # a matrix product, however this build of PyTorch names it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.FREE and not self.launching:
            self.counts["product" if name in self.PRODUCTS else name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        count = self

        class Counted:  # stands in for a @triton.jit kernel: kernel[grid](...) counts one launch
            def __init__(self, name, kernel) -> None:
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    count.counts[self.name] += 1
                    count.launching = True
                    try:
                        return self.kernel[grid](*args, **kwargs)
                    finally:
                        count.launching = False
                return launch

        for (module, name), kernel in self.kernels.items():
            setattr(module, name, Counted(name, kernel))
        return super().__enter__()

    def __exit__(self, *exc):
        for (module, name), kernel in self.kernels.items():
            setattr(module, name, kernel)
        return super().__exit__(*exc)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_decode_step_launches_ten_kernels_a_layer(monkeypatch, batch_size):
    """The static decode step (what a graph captures), bfloat16, on the Triton path: per layer two norms, four
    products, rotary with the K/V write, decode attention and its merge, SwiGLU; per step the embedding, the
    rotary tables' two lookups, the last residual addition and the copy into the output buffer. Before the fused
    kernels (the README counts them): 28 a layer at one row, 30 from two rows on."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts on a CPU, the Triton kernels interpreted (on a GPU: torch.profiler, step_bench --profile)")
    monkeypatch.setenv("LLM_ATTENTION", "triton")
    runner_module, kv_cache = stage(FOLDER, "model_runner"), stage(FOLDER, "kv_cache")
    model = tiny_model(FOLDER, torch.bfloat16)
    shape = model.config.cache_shape(16, torch.bfloat16)
    cache = kv_cache.KVCache.allocate(shape, 8 * shape.bytes_per_block, torch.device("cpu"))
    runner = runner_module.ModelRunner(model, cache, 16, torch.device("cpu"), 4, 256)
    rows = [(5 + 9 * i, [i]) for i in range(batch_size)]  # (context, table): one block each
    step = runner_module.StepInput(
        input_ids=[3] * batch_size, positions=[length - 1 for length, _ in rows],
        slot_mapping=[table[0] * 16 + length - 1 for length, table in rows],
        query_start_loc=list(range(batch_size + 1)), seq_lens=[length for length, _ in rows],
        block_tables=[table for _, table in rows], logits_indices=list(range(batch_size)), prompt_logits_indices=[],
        num_prompt_logits=[0] * batch_size)
    size = runner.bucket(step)
    runner.buffers.load(step, size)
    with torch.inference_mode(), KernelCount(stage(FOLDER, "fused"), stage(FOLDER, "triton_attention")) as count:
        runner.forward_static(size)
    layers = model.config.num_layers
    per_layer = {"product": 4, "_rms_norm_kernel": 2, "_rotary_and_write_kv_kernel": 1, "_decode_kernel": 1,
                 "_merge_splits_kernel": 1, "_silu_and_mul_kernel": 1}
    per_step = {"embedding": 1, "index": 2, "add": 1, "copy_": 1}
    assert dict(count.counts) == {**{name: n * layers for name, n in per_layer.items()}, **per_step}
    assert sum(count.counts.values()) == 10 * layers + 5


# --- captured in a CUDA graph -----------------------------------------------------------------------------------


@pytest.mark.cuda
def test_the_fused_kernels_replay_in_a_cuda_graph(fused):
    """Norm, rotary with the K/V write, and SwiGLU captured in one graph on static tensors; new values copied in,
    a replay gives the reference's answers for them, and padding still writes nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    attention = stage(fused.__package__, "attention")
    dtype, rows, heads, kv_heads, head_dim, hidden = torch.bfloat16, 4, 8, 2, 64, 256
    x, residual = torch.zeros(rows, hidden, dtype=dtype, device="cuda"), torch.zeros(rows, hidden, dtype=dtype,
                                                                                    device="cuda")
    weight = torch.ones(hidden, dtype=dtype, device="cuda")
    qkv = torch.zeros(rows, heads + 2 * kv_heads, head_dim, dtype=dtype, device="cuda")
    cos, sin = torch.ones(rows, 1, head_dim // 2, device="cuda"), torch.zeros(rows, 1, head_dim // 2, device="cuda")
    gate_up = torch.zeros(rows, 2 * hidden, dtype=dtype, device="cuda")
    k_cache, v_cache = (torch.full((4, 4, kv_heads, head_dim), SENTINEL, dtype=dtype, device="cuda") for _ in "kv")
    meta = metadata(attention, [-1] * rows, "cuda")

    def step():
        return (*fused.add_rms_norm(x, residual, weight, 1e-5), fused.silu_and_mul(gate_up),
                fused.rotary_and_write_kv(qkv, cos, sin, k_cache, v_cache, meta, heads))

    step()  # compiles the kernels outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for tensor, seed in ((x, 1), (residual, 2), (weight, 3), (qkv, 4), (gate_up, 5)):
        tensor.copy_(randn(*tensor.shape, seed=seed, dtype=dtype, device="cuda"))
    angles = randn(rows, 1, head_dim // 2, seed=6, dtype=torch.float32, device="cuda")
    cos.copy_(angles.cos())
    sin.copy_(angles.sin())
    meta.slot_mapping.copy_(torch.tensor([3, -1, 0, 9]))
    graph.replay()
    torch.cuda.synchronize()
    k_expected, v_expected = (torch.full_like(k_cache, SENTINEL) for _ in "kv")
    expected = (*fused.add_rms_norm_reference(x, residual, weight, 1e-5), fused.silu_and_mul_reference(gate_up),
                fused.rotary_and_write_kv_reference(qkv, cos, sin, k_expected, v_expected, meta, heads))
    for actual, wanted in zip(outputs, expected, strict=True):
        assert_close(actual, wanted)
    assert_close(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)
