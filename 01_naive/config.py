"""Every knob of the engine, in one place.

Each stage adds the fields its lesson needs. The command line (``python -m NN_name --help`` has one
flag per field), the server, the tests and the benchmark all build the engine from this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.cli import DEVICES, DTYPES
from common.weights import DEFAULT_MODEL


@dataclass
class EngineConfig:
    model: str = field(default=DEFAULT_MODEL,
                       metadata={"help": "embedded model name or a local Hugging Face folder"})
    device: str = field(default="auto", metadata={"help": "auto picks CUDA when present", "choices": DEVICES})
    dtype: str = field(default="auto", metadata={"help": "auto is float32 on CPU, bfloat16 on CUDA",
                                                 "choices": DTYPES})
