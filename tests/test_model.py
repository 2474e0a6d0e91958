"""Each stage's own model (stage 03 on) computes what Hugging Face computes, through the paged KV cache.

Every comparison runs one sequence the way the engine does, a prefill step then one decode step
per token, with its K/V scattered over shuffled blocks of a pool filled with large random garbage (a slot
used before it is written would wreck the logits), and compares every position's logits with
Hugging Face's forward over the whole sequence. The embedded SmolLM2 is checked on a chat prompt;
tiny random checkpoints cover what SmolLM2 does not have: Llama 3 RoPE scaling, untied embeddings,
biases, Qwen2, Mistral, a head_dim that is not hidden / heads, and weights split over shards.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import stage
from .stages import changed_stages_with

STAGES = changed_stages_with("model", "attention", "triton_attention", "kv_cache")


@pytest.fixture(scope="module", params=STAGES)
def lib(request) -> SimpleNamespace:
    """The model, attention and kv_cache modules of one stage that has its own model (03 on)."""
    return SimpleNamespace(**{name: stage(request.param, name) for name in ("model", "attention", "kv_cache")})


def step_meta(lib, cached_new: list[tuple[int, int]], slots: list[int], tables: list[list[int]]):
    """The metadata of one step: sequence i has cached_new[i][0] tokens cached and adds cached_new[i][1]."""
    starts = [0]
    for _, new in cached_new:
        starts.append(starts[-1] + new)
    return lib.attention.AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_lens=torch.tensor([new for _, new in cached_new], dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in cached_new], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(new for _, new in cached_new),
        logits_indices=torch.tensor(starts[1:]) - 1,
    )

CPU = torch.device("cpu")
BLOCK_SIZE = 16
DECODE_STEPS = 20
ATOL = 1e-4


# --- the harness: one sequence, a prefill and decode steps, through shuffled blocks -----------------


class PagedSequence:
    """One sequence run step by step through ``model``, as the engine runs it, in its own small pool."""

    def __init__(self, lib, model, num_blocks: int = 8, seed: int = 0) -> None:
        shape = model.config.cache_shape(BLOCK_SIZE, torch.float32)
        self.lib = lib
        self.model = model
        self.cache = lib.kv_cache.KVCache.allocate(shape, num_blocks * shape.bytes_per_block, CPU)
        # Garbage in every slot, large enough to wreck the logits if attention used a slot it never wrote
        # (finite, not NaN: stage 04's batched decode reads padding and gives it weight 0, and 0 * NaN is NaN).
        self.cache.data.normal_(0.0, 1e3, generator=torch.Generator().manual_seed(seed))
        # Not [0, 1, 2, ...]: position p's block is wherever the table says, not p // BLOCK_SIZE.
        self.block_table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.length = 0  # tokens in the cache

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Run the next tokens (the whole prompt first, then one at a time); their logits: [len, V]."""
        start, end = self.length, self.length + len(token_ids)
        assert end <= len(self.block_table) * BLOCK_SIZE, "the test pool is too small"
        slots = [self.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        meta = step_meta(self.lib, [(start, len(token_ids))], slots, [self.block_table])
        hidden = self.model(torch.tensor(token_ids), torch.arange(start, end), self.cache, meta)
        self.length = end
        return self.model.compute_logits(hidden)


@torch.inference_mode()
def greedy_logits(lib, model, prompt_ids: list[int], steps: int = DECODE_STEPS) -> tuple[list[int], torch.Tensor]:
    """Prefill, then ``steps`` greedy decode steps: (the tokens fed to decode, logits of every position)."""
    sequence = PagedSequence(lib, model)
    logits = [sequence.step(prompt_ids)]  # [T, V]
    fed: list[int] = []
    for _ in range(steps):
        fed.append(int(logits[-1][-1].argmax()))
        logits.append(sequence.step(fed[-1:]))  # [1, V]
    return fed, torch.cat(logits)  # [T + steps, V]


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Hugging Face's forward over the whole sequence at once, no cache: [len, V]."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_matches_hf(lib, ours, hf_model, prompt_ids: list[int]) -> float:
    """Our prefill and decode logits against Hugging Face's; returns the largest difference."""
    fed, logits = greedy_logits(lib, ours, prompt_ids)
    reference = hf_logits(hf_model, prompt_ids + fed)
    assert logits.shape == reference.shape == (len(prompt_ids) + DECODE_STEPS, ours.config.vocab_size)
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)
    return float((logits - reference).abs().max())


# --- the embedded model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ours(lib, model_dir: Path):
    return lib.model.LlamaForCausalLM.from_pretrained(model_dir, torch.float32, CPU)


def test_embedded_model_matches_hf_on_a_chat_prompt(lib, ours, hf):
    hf_model, tokenizer = hf
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False).input_ids  # as Engine.encode_chat does
    assert len(prompt_ids) > BLOCK_SIZE  # the prompt spans blocks, and decoding crosses into another
    print(f"max |logits - hf| = {assert_matches_hf(lib, ours, hf_model, prompt_ids):.2e}")


def test_embedded_config(lib, ours, model_dir: Path):
    config = ours.config
    assert config == lib.model.ModelConfig.from_pretrained(model_dir)
    assert (config.model_type, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.eos_token_ids == [2]
    assert config.tie_word_embeddings and ours.lm_head is None
    assert (config.rope_theta, config.rope_scaling) == (100000.0, None)
    assert not (config.attention_bias or config.o_proj_bias or config.mlp_bias)
    # 30 layers x 3 KV heads x 64 dims x K and V x 2 bytes
    assert config.cache_shape(16, torch.bfloat16).bytes_per_token == 30 * 3 * 64 * 2 * 2


# --- tiny random checkpoints of every supported kind --------------------------------------------------

# The transformers config keys these rely on (and ModelConfig.from_hf reads): vocab_size, hidden_size,
# intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
# rope_parameters (rope_type, rope_theta, factor, low_freq_factor, high_freq_factor,
# original_max_position_embeddings), tie_word_embeddings, attention_bias, mlp_bias, sliding_window,
# use_sliding_window, eos_token_id.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # scales most of head_dim 16
VARIANTS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama_untied_bias": ("LlamaConfig", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),  # q/k/v biases, always
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, head_dim=32, sliding_window=4096)),
}


def save_tiny_checkpoint(kind: str, folder: Path, max_shard_size: str = "50GB"):
    """A random model of ``VARIANTS[kind]``, saved as a Hugging Face folder; returns the model, float32."""
    import transformers

    class_name, extra = VARIANTS[kind]
    config = getattr(transformers, class_name)(**TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Hugging Face initialises biases to 0 and norms to 1: make every tensor count
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return model


def copy_tokenizer(model_dir: Path, folder: Path) -> None:
    """Give a tiny checkpoint the course model's tokenizer, so that the stages can load it as a model folder."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((model_dir / name).read_bytes())


SHARDED = "llama_untied_bias"  # saved in several files, to load a checkpoint the way big ones come


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(lib, request, tmp_path_factory):
    """(kind, folder, our model, the Hugging Face model it was saved from)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_checkpoint(request.param, folder, max_shard_size="40KB" if request.param == SHARDED
                                    else "50GB")
    return request.param, folder, lib.model.LlamaForCausalLM.from_pretrained(folder, torch.float32, CPU), hf_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny Llama with tied embeddings, in one file."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_checkpoint("llama", folder)
    return folder


def test_tiny_checkpoint_matches_hf(lib, tiny):
    _, _, ours_tiny, hf_model = tiny
    prompt_ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_matches_hf(lib, ours_tiny, hf_model, prompt_ids)


def test_tiny_checkpoint_config(lib, tiny):
    kind, folder, ours_tiny, hf_model = tiny
    config = ours_tiny.config
    assert (len(list(folder.glob("*.safetensors"))) > 1) == (kind == SHARDED)
    assert config.model_type == hf_model.config.model_type
    assert config.tie_word_embeddings == (ours_tiny.lm_head is None) == (kind in ("llama", "llama3_rope", "qwen2"))
    assert config.attention_bias == (kind in ("llama_untied_bias", "qwen2"))
    assert config.o_proj_bias == config.mlp_bias == (kind == "llama_untied_bias")
    assert config.head_dim == (32 if kind == "mistral" else 16)
    assert config.max_position_embeddings == (4096 if kind == "mistral" else hf_model.config.max_position_embeddings)
    # Our RoPE frequencies are Hugging Face's, and Llama 3's scaling really changes them here.
    frequencies = lib.model.rope_frequencies(config)
    torch.testing.assert_close(frequencies, hf_model.model.rotary_emb.inv_freq)
    unscaled = lib.model.rope_frequencies(replace(config, rope_scaling=None))
    assert torch.equal(frequencies, unscaled) == (kind != "llama3_rope")


@torch.inference_mode()
def test_two_sequences_in_one_step_match_each_alone(lib, tiny_folder):
    """The flat step is ready for batching: two prompts in one prefill, then both in one decode step."""
    model = lib.model.LlamaForCausalLM.from_pretrained(tiny_folder, torch.float32, CPU)
    prompts = [list(range(3, 23)), list(range(100, 107))]  # 20 and 7 tokens
    alone = [PagedSequence(lib, model, seed=i) for i in range(2)]
    expected_prefill = [sequence.step(prompt) for sequence, prompt in zip(alone, prompts, strict=True)]
    expected_decode = [sequence.step([5]) for sequence in alone]

    shape = model.config.cache_shape(BLOCK_SIZE, torch.float32)
    cache = lib.kv_cache.KVCache.allocate(shape, 4 * shape.bytes_per_block, CPU)
    tables = [[2, 0], [3, 1]]  # each sequence's blocks, interleaved in the pool

    def slot(seq: int, position: int) -> int:
        return tables[seq][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    lens = [len(prompt) for prompt in prompts]
    prefill = step_meta(lib, [(0, n) for n in lens], [slot(s, p) for s in range(2) for p in range(lens[s])], tables)
    positions = torch.cat([torch.arange(n) for n in lens])
    logits = model.compute_logits(model(torch.tensor(prompts[0] + prompts[1]), positions, cache, prefill))
    torch.testing.assert_close(logits, torch.cat(expected_prefill), atol=ATOL, rtol=0)

    decode = step_meta(lib, [(n, 1) for n in lens], [slot(s, lens[s]) for s in range(2)], tables)
    logits = model.compute_logits(model(torch.tensor([5, 5]), torch.tensor(lens), cache, decode))
    torch.testing.assert_close(logits, torch.cat(expected_decode), atol=ATOL, rtol=0)


# --- reading config.json ------------------------------------------------------------------------------


def llama_config(**overrides) -> dict:
    return {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, **overrides}


def test_config_before_transformers_5(lib):
    """Llama 3.1's config.json as published: rope_theta at the top, rope_scaling beside it, EOS lists."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = lib.model.ModelConfig.from_hf(
        llama_config(rope_theta=500000.0, rope_scaling=scaling, eos_token_id=[128001, 128008, 128009]),
        {"eos_token_id": [128001, 128009, 128256]})
    assert config.head_dim == 4096 // 32  # no head_dim key: hidden / heads
    assert (config.rope_theta, config.rope_scaling) == (500000.0, scaling)
    assert config.eos_token_ids == [128001, 128008, 128009, 128256]
    assert not config.tie_word_embeddings  # no key: the default of these models


def test_config_defaults_the_llama3_pretraining_length(lib):
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0}
    config = lib.model.ModelConfig.from_hf(llama_config(rope_parameters=scaling))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["original_max_position_embeddings"] == 131072
    assert config.eos_token_ids == []


def test_config_qwen2_and_mistral(lib):
    qwen2 = lib.model.ModelConfig.from_hf(llama_config(model_type="qwen2", sliding_window=32768,
                                                       use_sliding_window=False, eos_token_id=151645))
    assert (qwen2.attention_bias, qwen2.o_proj_bias) == (True, False)
    assert qwen2.max_position_embeddings == 131072  # its sliding_window is switched off
    mistral = lib.model.ModelConfig.from_hf(llama_config(model_type="mistral", head_dim=None, sliding_window=4096))
    assert mistral.head_dim == 128  # head_dim: null means hidden / heads
    assert mistral.max_position_embeddings == 4096  # no windowed attention: served up to the window only


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_config_refuses_what_the_model_cannot_run(lib, overrides, message):
    with pytest.raises(ValueError, match=message):
        lib.model.ModelConfig.from_hf(llama_config(**overrides))


# --- loading strictly -----------------------------------------------------------------------------------


def edited_copy(source: Path, destination: Path, edit) -> Path:
    """A copy of the one-file checkpoint ``source`` whose tensors went through ``edit(dict)``."""
    destination.mkdir()
    shutil.copy(source / "config.json", destination / "config.json")
    weights = load_file(source / "model.safetensors")
    edit(weights)
    save_file(weights, destination / "model.safetensors")
    return destination


def test_a_missing_tensor_is_a_clear_error(lib, tiny_folder, tmp_path):
    folder = edited_copy(tiny_folder, tmp_path / "missing",
                         lambda weights: weights.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(lib.model.CheckpointMismatch, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight, "
                                                           r"unexpected none"):
        lib.model.LlamaForCausalLM.from_pretrained(folder, torch.float32, CPU)


def test_an_unexpected_tensor_is_a_clear_error(lib, tiny_folder, tmp_path):
    def add_a_layer(weights: dict) -> None:
        weights["model.layers.2.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"].clone()

    folder = edited_copy(tiny_folder, tmp_path / "extra", add_a_layer)
    with pytest.raises(lib.model.CheckpointMismatch, match=r"missing none, unexpected model\.layers\.2\."):
        lib.model.LlamaForCausalLM.from_pretrained(folder, torch.float32, CPU)


def test_a_tied_checkpoint_may_store_lm_head_and_old_rotary_buffers(lib, tiny_folder, tmp_path):
    def add_redundant(weights: dict) -> None:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
        weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    folder = edited_copy(tiny_folder, tmp_path / "redundant", add_redundant)
    model = lib.model.LlamaForCausalLM.from_pretrained(folder, torch.bfloat16, CPU)
    assert model.lm_head is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos.dtype == torch.float32  # the angles stay exact in a bfloat16 model


def test_a_folder_without_weights_is_a_clear_error(lib, tiny_folder, tmp_path):
    shutil.copy(tiny_folder / "config.json", tmp_path / "config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    with pytest.raises(FileNotFoundError, match=r"has no \*\.safetensors file"):
        lib.model.LlamaForCausalLM.from_pretrained(tmp_path, torch.float32, CPU)


# --- matmul.py: the linear layer's CPU paths (one file, the same from stage 03 on) ---------------------------------


@pytest.mark.parametrize("rows", [1, 3, 15, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_linear_computes_f_linear_by_whichever_path_it_takes(monkeypatch, rows, dtype):
    """Few float32 rows take the transposed product, many bfloat16 rows on a CPU without bfloat16 instructions the
    float32 product block by block (forced here, whatever this CPU has): each gives F.linear's answer in float32,
    to the last bits of its dtype."""
    matmul = stage("03_paged_kv", "matmul")
    monkeypatch.setattr(matmul, "NATIVE_BFLOAT16", False)
    monkeypatch.setattr(matmul, "UPCAST_BLOCK", 7)  # several blocks, the last one short
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, generator=generator).to(dtype)
    weight, bias = torch.randn(30, 24, generator=generator).to(dtype), torch.randn(30, generator=generator).to(dtype)
    exact = torch.nn.functional.linear(x.float(), weight.float(), bias.float())  # [rows, 30]
    for b in (bias, None):
        out = matmul.linear(x, weight, b)
        assert out.shape == (rows, 30) and out.dtype == dtype
        want = exact if b is not None else exact - bias.float()
        torch.testing.assert_close(out.float(), want.to(dtype).float(), **({} if dtype == torch.float32 else
                                                                         {"atol": 0.05, "rtol": 0.01}))
    if dtype == torch.bfloat16 and rows >= matmul.UPCAST_ROWS:  # the float32 product, rounded once: as exact as it gets
        torch.testing.assert_close(matmul.linear(x, weight, bias), exact.to(dtype), atol=0, rtol=0)
