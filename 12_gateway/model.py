"""A tensor-parallel Llama-family decoder (Llama, Qwen2, Mistral) whose attention reads the paged KV cache.

The model is ours, not Hugging Face's, so that every layer can hand its keys and values to
``paged_attention`` and the pool of blocks. It computes what Hugging Face computes (the tests
compare the logits), in about the same number of lines:

    token ids [T] -> embed -> N x (x + attention(norm(x)), then x + mlp(norm(x))) -> hidden [T, hidden]
    hidden rows the engine needs [N, hidden] -> norm -> lm_head -> logits [N, vocab]

The forward pass takes one *flat* step: ``T`` tokens with their own positions, not a padded
``[batch, length]`` tensor. Which sequence each token belongs to is the ``AttentionMetadata``'s
business; everything else in the model works token by token and never needs to know.

Module names follow Hugging Face's (``model.layers.0.self_attn.o_proj``, ...), with one change: the
matrices that read the same input are stacked into one, q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, so that a layer runs four matrix products instead of seven (one weight read, one call:
on a GPU, one kernel). Each output feature is still its own dot product, so the numbers do not change;
loading stacks the checkpoint's separate tensors (``checkpoint_parts``).

Between the products, the small operators go through ``fused.py``: each residual addition with the RMSNorm
after it, SwiGLU's activation with its product, rotary embedding with the K/V write. On CUDA each group
is one kernel; elsewhere the same PyTorch operators as before run, so that the numbers do not change either.

Every layer with a weight matrix is a parallel layer (``parallel.py``), built for this
process's rank of ``tp``: q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel (an
all-reduce each), the embedding and the output projection split by vocabulary. Each rank loads only its
own slices of the checkpoint. With one rank (``tp.size`` 1) every slice is the whole tensor and, without a
process group (the default), every collective does nothing: the same model as stage 08.

Loaded with a quantization mode other than "none", the model is built and loaded in float as always, and then
each weight matrix is replaced by one kept in fewer bytes (``quantize``, ``quantize.py``): int4 in blocks of 32 for
the linear layers (from the GGUF's own blocks where the model came from one), int8 per row for the embedding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from common.gguf_blocks import read_blocks
from common.weights import source_gguf

from .attention import AttentionMetadata, paged_attention
from .distributed import SINGLE, TPGroup
from .fused import add_rms_norm, rms_norm, rotary_and_write_kv, silu_and_mul
from .kv_cache import CacheShape, KVCache
from .matmul import linear
from .parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    column_row_pair,
    even_shard,
    head_shards,
)
from .quantize import Int4Weight, Int8Weight, QuantizedWeight, q4_1_blocks, shard_blocks, stack_blocks

if TYPE_CHECKING:
    from common.gguf_blocks import Blocks

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


# --- the configuration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The few numbers of ``config.json`` the forward pass needs, under names that say what they are."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; Llama 3's parameters when rope_type is "llama3"
    max_position_embeddings: int
    tie_word_embeddings: bool  # the output projection reuses the embedding matrix (SmolLM2 does)
    attention_bias: bool  # q, k and v projections have a bias (Qwen2 does)
    o_proj_bias: bool  # the output projection of attention has one (Llama with attention_bias only)
    mlp_bias: bool
    eos_token_ids: list[int]

    @classmethod
    def from_hf(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Read a Hugging Face ``config.json`` (and ``generation_config.json``, for more EOS ids)."""
        model_type = config["model_type"]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported: only {', '.join(SUPPORTED_MODEL_TYPES)}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported: only silu (SwiGLU)")
        rope_theta, rope_scaling = _rope_parameters(config)
        max_len = config["max_position_embeddings"]
        # We have no sliding-window attention. Up to the window's length it is plain causal attention,
        # so a Mistral with a window is served only that far: the same model, a shorter context.
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        # Qwen2 always has q/k/v biases (and no key for it); Llama's attention_bias covers o_proj too.
        qkv_bias = model_type == "qwen2" or config.get("attention_bias", False)
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=min(max_len, window) if window else max_len,
            tie_word_embeddings=config.get("tie_word_embeddings", False),  # False: these models' default
            attention_bias=qkv_bias,
            o_proj_bias=model_type != "qwen2" and config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
            eos_token_ids=_eos_token_ids(config, generation_config or {}),
        )

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> ModelConfig:
        generation = model_dir / "generation_config.json"
        return cls.from_hf(json.loads((model_dir / "config.json").read_text()),
                           json.loads(generation.read_text()) if generation.is_file() else None)

    def cache_shape(self, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> CacheShape:
        """The geometry of one rank's KV-cache blocks: only its own KV heads (one, when they are replicated)."""
        return CacheShape(self.num_layers, max(1, self.num_kv_heads // tp_size), self.head_dim, block_size, dtype)

    def tensor_parallel_sizes(self) -> list[int]:
        """Every number of ranks this model splits across, from 1 to its number of query heads: those that give
        each rank whole query heads, whole KV heads (its own or a replicated one), and an equal share of the MLP's
        features and of the vocabulary."""
        ### BEGIN SOLUTION 9.4
        return [n for n in range(1, self.num_heads + 1)
                if self.num_heads % n == 0 and (self.num_kv_heads % n == 0 or n % self.num_kv_heads == 0)
                and self.intermediate_size % n == 0 and self.vocab_size % n == 0]
        ### END SOLUTION

    def check_tensor_parallel_size(self, size: int) -> None:
        """Refuse, in one line, a number of ranks the model does not split across."""
        if size not in (sizes := self.tensor_parallel_sizes()):
            raise ValueError(f"--tensor-parallel-size {size} does not split this model ({self.num_heads} query heads, "
                             f"{self.num_kv_heads} KV heads, {self.intermediate_size} MLP features, vocabulary "
                             f"{self.vocab_size}): use one of {', '.join(map(str, sizes))}")


def _rope_parameters(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None). transformers 5 writes ``rope_parameters``; older files
    have ``rope_theta`` and ``rope_scaling`` (whose type may be called ``type``)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported: only default and llama3")
    # Hugging Face's default for the pretraining length, when the file leaves it out.
    rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return theta, rope


def _eos_token_ids(config: dict[str, Any], generation_config: dict[str, Any]) -> list[int]:
    """Every EOS id either file names (each may hold one id, a list, or null), in order, once each."""
    ids: list[int] = []
    for source in (config, generation_config):
        value = source.get("eos_token_id")
        for token_id in value if isinstance(value, list) else [] if value is None else [value]:
            if token_id not in ids:
                ids.append(token_id)
    return ids


# --- the building blocks ------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned weight (no mean, no bias):
    ``x / sqrt(mean(x^2) + eps) * weight``. Given the residual stream too, ``x`` joins it first, and the norm
    hands back the new stream with its output (``fused.add_rms_norm``: one kernel on CUDA)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [T, hidden] -> norm(x); with residual [T, hidden] -> (norm(residual + x), residual + x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotation speed of each pair of dimensions, ``theta ** (-2i / D)``: [D / 2] float32.

    Llama 3 stretches the slow ones (wavelength above ``original_max / low_freq_factor``) by
    ``factor`` so the model reaches a longer context, keeps the fast ones (below
    ``original_max / high_freq_factor``), and blends the two in between.
    """
    dim = config.head_dim
    # device="cpu": a real tensor even when from_pretrained builds the model on the meta device.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is None:
        return inv_freq
    scaling = config.rope_scaling
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    # 0 where the wavelength is long (divide by factor), 1 where it is short (keep), linear between.
    smooth = ((scaling["original_max_position_embeddings"] / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """cos and sin of every position's rotation angles, computed once, looked up by position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_frequencies(config)  # [D / 2]
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        angles = torch.outer(positions, inv_freq)  # [max_positions, D / 2]
        # Not in the checkpoint (persistent=False); float32 whatever the model's dtype.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, D / 2] (the 1 broadcasts over heads)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class Attention(nn.Module):
    """Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` key/value heads.

    Split by heads across the ranks: each computes its own query heads against its own KV heads (and
    caches only those), and o_proj, row-parallel, sums the heads' contributions over the ranks."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        q_rows, kv_rows = head_shards(config.num_heads, config.num_kv_heads, config.head_dim, tp)
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = q_rows.size // self.head_dim, kv_rows.size // self.head_dim  # this rank's
        # q, k and v stacked: this rank's rows of each, [q_size + 2 * kv_size, hidden] / N, one matrix product;
        # o_proj reads this rank's heads' outputs.
        self.qkv_proj, self.o_proj = column_row_pair(config.hidden_size, [q_rows, kv_rows, kv_rows],
                                                     (config.attention_bias, config.o_proj_bias), tp)
        self.scale = config.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; kv_cache: this layer's K and V pools, each [num_blocks, block_size, Hkv, D]
        # (H and Hkv: this rank's heads)
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)  # [T, H + 2 Hkv, D]
        # q and k rotated, k and v stored in the step's cache slots (one kernel on CUDA): q [T, H, D]
        q = rotary_and_write_kv(qkv, cos, sin, *kv_cache, meta, self.num_heads)
        out = paged_attention(q, *kv_cache, meta, self.scale)  # [T, H, D]: over the cache, this step's K/V in it
        return self.o_proj(out.flatten(1))  # [T, hidden]: summed over the ranks' heads


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, the gate deciding how much of each feature passes.

    Split by features: each rank computes its 1/N of them (gate and up column-parallel, SwiGLU works
    feature by feature), and down_proj, row-parallel, sums their contributions over the ranks."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        rows = even_shard(config.intermediate_size, tp)
        # gate and up stacked: this rank's features of each, [2 * intermediate / N, hidden], one matrix product;
        # down_proj reads this rank's features after SwiGLU.
        self.gate_up_proj, self.down_proj = column_row_pair(config.hidden_size, [rows, rows],
                                                            (config.mlp_bias, config.mlp_bias), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> gate, up: [T, intermediate / N] each, stacked -> silu(gate) * up -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

    Written with the residual stream carried beside each block's output, so that every addition happens
    inside the norm that reads its result (``fused.add_rms_norm``): the layer adds what the last layer's
    MLP gave to the stream, normalizes it, attends, adds that, normalizes again, and hands on its MLP's
    output with the stream. The sums are the same ones, in the same order."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, hidden], what joins the stream here (the first layer: the embedding, and residual None: the stream
        # starts with it) -> (this layer's MLP output, the stream before it), [T, hidden] each
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)  # residual + x, and its norm
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """The embedding, the decoder layers and the final norm (applied by ``compute_logits``)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)  # looked up once per step, shared by every layer
        residual = None  # the residual stream: the embedding, then every block's output added to it
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, kv_cache.layer(i), meta)
        return residual + x  # the last MLP's output joins the stream


# --- the whole model, and loading it -----------------------------------------------------------------


class CheckpointMismatch(ValueError):
    """The safetensors do not hold exactly the tensors the model has."""


# The stacked matrices, and the checkpoint's tensors each is made of, in order.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_parts(name: str) -> list[str]:
    """The checkpoint tensors a parameter is made of: ``model.layers.0.mlp.gate_up_proj.weight`` ->
    ``[model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight]``; any other parameter is its own."""
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    return [f"{parent}.{part}.{param}" for part in STACKED[leaf]] if leaf in STACKED else [name]


class LlamaForCausalLM(nn.Module):
    """The decoder and its output projection: a step's hidden states, then the logits of the rows asked for."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp)
        # Tied: the logits reuse the embedding matrix (this rank's rows of it), and there is no lm_head to load.
        # Untied: a column-parallel layer whose output features are token ids, split as the embedding is.
        self.lm_head = (None if config.tie_word_embeddings
                        else ColumnParallelLinear(config.hidden_size, [even_shard(config.vocab_size, tp)], bias=False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Run one step's tokens (every sequence's, end to end) and write their K/V into the cache."""
        # input_ids, positions: [T] int64 -> hidden: [T, hidden], before the final norm
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of only the rows asked for: a prefill samples from its last token, not from all T.
        Each rank scores its slice of the vocabulary; rank 0 gathers them (the other ranks get None)."""
        # hidden: [R, hidden] -> logits: [R, vocab] float32 on rank 0, what the sampler wants
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V / N, hidden]
        return self.tp.gather(linear(self.model.norm(hidden), weight).float())  # [R, V / N] per rank -> [R, V]

    def weight_shards(self) -> dict[str, Shard]:
        """Which slice of each checkpoint tensor this rank holds, by the checkpoint's name (the tensors it holds
        whole: absent). A stacked parameter (qkv_proj) lists one slice per tensor it is made of (q, k, v)."""
        return {part: shard for prefix, module in self.named_modules()
                for name, shards in getattr(module, "shards", {}).items() if getattr(module, name) is not None
                for part, shard in zip(checkpoint_parts(f"{prefix}.{name}"), shards, strict=True)}

    @property
    def num_weight_bytes(self) -> int:
        """What this rank's slices of the weights take, quantized or not."""
        quantized = [m for m in self.modules() if isinstance(m, QuantizedWeight)]
        return sum(p.numel() * p.element_size() for p in self.parameters()) + sum(m.num_bytes for m in quantized)

    @property
    def num_unquantized_bytes(self) -> int:
        """What the same weights would take in float (in their dtype): ``num_weight_bytes`` unquantized."""
        return sum(p.numel() * p.element_size() for p in self.parameters()) + sum(
            m.shape.numel() * m.dtype.itemsize for m in self.modules() if isinstance(m, QuantizedWeight))

    def quantize(self, mode: str, blocks: dict[str, Blocks] | None = None) -> None:
        """Replace each weight matrix by one kept in ``mode``'s bytes (``quantize.MODES``; "none" keeps them):
        int4 for the linear layers, from ``blocks`` (a GGUF's, by checkpoint name) where given, else put in blocks
        of their float weights; int8 per row for the embedding and an untied output projection, in both modes."""
        if mode == "none":
            return
        shards = self.weight_shards()  # this rank's slice of each checkpoint tensor, to cut the file's blocks
        for prefix, module in list(self.named_modules()):
            if isinstance(module, VocabParallelEmbedding) or module is self.lm_head or (
                    mode == "int8" and isinstance(module, ColumnParallelLinear | RowParallelLinear)):
                quantized: QuantizedWeight = Int8Weight.from_float(module.weight)
            elif isinstance(module, ColumnParallelLinear | RowParallelLinear):  # int4
                parts = checkpoint_parts(f"{prefix}.weight")  # [q, k, v] of qkv_proj
                found = (stack_blocks([shard_blocks(blocks[part], shards.get(part)) for part in parts])
                         if blocks else q4_1_blocks(module.weight))
                quantized = Int4Weight(found.to(module.weight.device), module.weight.dtype)
            else:
                continue
            del module.weight  # the float parameter goes; the quantized one takes its name
            module.weight = quantized

    def dequantized_weights(self) -> dict[str, torch.Tensor]:
        """Every quantized weight as the float32 checkpoint tensors it stands for, by their names (a stacked one split
        back into its parts): what Hugging Face loads to compute with exactly this model's weights."""
        shards, found = self.weight_shards(), {}
        for prefix, module in self.named_modules():
            if isinstance(weight := getattr(module, "weight", None), QuantizedWeight):
                parts, full = checkpoint_parts(f"{prefix}.weight"), weight.dequantize()  # [out, in]
                pieces = full.split([shards[part].size for part in parts]) if len(parts) > 1 else [full]  # q, k, v
                found.update(zip(parts, pieces, strict=True))
        return found

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype, device: torch.device,
                        tp: TPGroup = SINGLE, quantization: str = "none") -> LlamaForCausalLM:
        """Build the model from ``config.json`` and load every ``*.safetensors`` file of the folder, strictly:
        this rank's slices of them, read straight from the files; then keep its weights in ``quantization``'s
        bytes (int4: the blocks of the GGUF the folder was converted from, where there is one)."""
        model_dir = Path(model_dir)
        config = ModelConfig.from_pretrained(model_dir)
        config.check_tensor_parallel_size(tp.size)
        with torch.device("meta"):  # shapes only: no memory, no random init the checkpoint would overwrite
            model = cls(config, tp)
        weights = load_safetensors(model_dir, dtype, torch.device(device), model.weight_shards())
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
        parts = {name: checkpoint_parts(name) for name in model.state_dict()}
        expected = {part for names in parts.values() for part in names}
        missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
        if missing or unexpected:
            raise CheckpointMismatch(f"{model_dir} does not fit a {config.model_type} model of this config: "
                                     f"missing {_names(missing)}, unexpected {_names(unexpected)}")
        stacked = {name: torch.cat([weights.pop(part) for part in names]) if len(names) > 1 else weights.pop(names[0])
                   for name, names in parts.items()}  # [q; k; v] and [gate; up] along the output features
        model.load_state_dict(stacked, assign=True)  # assign: the loaded tensors become the parameters
        model = model.to(device).requires_grad_(False).eval()  # .to moves the RoPE tables, built on the CPU
        gguf = source_gguf(model_dir) if quantization == "int4" else None
        model.quantize(quantization, read_blocks(gguf) if gguf is not None else None)  # packed on the device
        return model


def load_safetensors(model_dir: Path, dtype: torch.dtype, device: torch.device,
                     shards: dict[str, Shard] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of every file, by its Hugging Face name, in ``dtype`` on ``device``; of a tensor named in
    ``shards``, only that slice: ``get_slice`` reads just those bytes from the file, not the whole tensor."""
    shards = shards or {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved it; we compute it
                    continue
                shard = shards.get(name)
                tensor = f.get_tensor(name) if shard is None else f.get_slice(name)[shard.index()]
                weights[name] = tensor.to(dtype)
    return weights


def _names(names: list[str], limit: int = 5) -> str:
    """A readable list that stays one line when a whole model is missing."""
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
