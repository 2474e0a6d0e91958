"""The command-line flags that every stage shares, and turning them into a model folder."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path
from typing import TypeVar

from .weights import ModelNotFound, resolve_model

Config = TypeVar("Config")

# The choices of the flags every stage shares, for the EngineConfig fields that use them.
DEVICES = ["auto", "cpu", "cuda"]
DTYPES = ["auto", "float32", "bfloat16", "float16"]


def stage_parser(package: str, config_type: type | None = None) -> argparse.ArgumentParser:
    """The stage's command line: its title and port come from the package, its engine flags from the
    fields of its ``EngineConfig`` (one flag per field, help from the field's metadata)."""
    stage = importlib.import_module(package)
    parser = argparse.ArgumentParser(prog=f"python -m {package}", description=stage.__doc__)
    parser.add_argument("--demo", action="store_true", help="run a few prompts in-process and print timings, no server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=stage.PORT)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per demo prompt")
    if config_type is not None:
        add_config_args(parser, config_type)
    return parser


def add_config_args(parser: argparse.ArgumentParser, config_type: type) -> None:
    """One flag per field of a config dataclass, its help from the field's metadata."""
    for f in dataclasses.fields(config_type):
        default = f.default
        flag, help_text = f"--{f.name.replace('_', '-')}", f"{f.metadata['help']} (default: {default})"
        if isinstance(default, bool):  # a switch: --enforce-eager, and --no-enforce-eager to undo it
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=type(default), default=default, help=help_text,
                                choices=f.metadata.get("choices"))


def config_from_args(config_type: type[Config], args: argparse.Namespace) -> Config:
    """The stage's ``EngineConfig`` from the parsed flags; ``--model`` resolved to a folder (or exit 2)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_type)}
    values["model"] = str(model_dir_or_exit(values["model"]))
    return config_type(**values)


def model_dir_or_exit(name_or_path: str) -> Path:
    """Resolve --model, or print one line that says what to do and exit with status 2."""
    try:
        return resolve_model(name_or_path)
    except ModelNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def served_name(name_or_path: str) -> str:
    """The name clients put in "model": the embedded name, or the folder's name."""
    path = Path(name_or_path)
    return path.name if path.is_dir() else name_or_path


DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]
