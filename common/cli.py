"""The command-line flags that every stage shares, and turning them into a model folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .weights import DEFAULT_MODEL, ModelNotFound, resolve_model


def stage_parser(prog: str, description: str, default_port: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("--demo", action="store_true", help="run a few prompts in-process and print timings, no server")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"embedded model name or a local Hugging Face folder (default: {DEFAULT_MODEL})")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto picks CUDA when present")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto is float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per demo prompt")
    return parser


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
