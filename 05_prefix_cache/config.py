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
    # The paged KV cache.
    kv_cache_mb: int = field(default=0, metadata={
        "help": "KV-cache pool size in MiB; 0 is 512 on a CPU and, on CUDA, what the card has left"})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "on CUDA, the share of free memory (after the weights) the pool takes"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block", "choices": [16, 32, 64, 128]})
    # Continuous batching.
    max_num_seqs: int = field(default=64, metadata={"help": "the largest decode batch"})
    max_num_batched_tokens: int = field(default=4096, metadata={"help": "the most prompt tokens one prefill step runs"})
    # The prefix cache.
    prefix_cache: str = field(default="hash", metadata={
        "help": "how cached blocks are found: a chained SHA-256 per block, a radix tree of token blocks, or off",
        "choices": ["hash", "radix", "off"]})
