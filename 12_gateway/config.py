"""Every knob of the engine, in one place.

Each stage adds the fields its lesson needs. The command line (``python -m NN_name --help`` has one
flag per field), the server, the tests and the benchmark all build the engine from this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.cli import DEVICES, DTYPES
from common.weights import DEFAULT_MODEL

# The step's token budget when --max-num-batched-tokens is 0. On this course's 2-core CPU a prompt token costs about
# 2 ms: beside 16 decodes, a chunk of 240 makes a step of 0.5 to 1.5 s (more as the prompt grows), and the step's
# fixed cost (reading every weight once, about 60 ms) is small beside it. The mixed workload (python -m common.mixed)
# measures the trade-off across budgets: 256 is the smallest whose long prompts wait no longer than with more (see
# the stage README). A GPU computes thousands of tokens in the time it reads the weights once: vLLM takes 8192 there.
CPU_TOKEN_BUDGET = 256
CUDA_TOKEN_BUDGET = 8192


@dataclass
class EngineConfig:
    model: str = field(default=DEFAULT_MODEL,
                       metadata={"help": "embedded model name or a local Hugging Face folder"})
    device: str = field(default="auto", metadata={"help": "auto picks CUDA when present", "choices": DEVICES})
    dtype: str = field(default="auto", metadata={"help": "auto is float32 on CPU, bfloat16 on CUDA",
                                                 "choices": DTYPES})
    # Quantized weights.
    quantization: str = field(default="auto", metadata={
        "help": "how the weights are kept and multiplied: int4 in blocks of 32 (from the GGUF's own Q4_1 blocks where "
                "the model came from one), int8 per output row, or none (float, as in stage 10); auto is int4 for a "
                "model that ships in 4-bit blocks (the course's) and none for a float checkpoint",
        "choices": ["auto", "none", "int8", "int4"]})
    # The paged KV cache.
    kv_cache_mb: int = field(default=0, metadata={
        "help": "KV-cache pool size in MiB; 0 is 512 on a CPU and, on CUDA, what the card has left"})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "on CUDA, the share of free memory (after the weights) the pool takes"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block", "choices": [16, 32, 64, 128]})
    # Continuous batching.
    max_num_seqs: int = field(default=64, metadata={"help": "the largest decode batch"})
    # Chunked prefill: one token budget holds every step, its decodes and its prompt chunks.
    max_num_batched_tokens: int = field(default=0, metadata={
        "help": "the token budget of one step, decodes and prompt chunks together (at least max_num_seqs); "
                f"0 is {CPU_TOKEN_BUDGET} on a CPU and {CUDA_TOKEN_BUDGET} on CUDA"})
    # The prefix cache.
    prefix_cache: str = field(default="hash", metadata={
        "help": "how cached blocks are found: a chained SHA-256 per block, a radix tree of token blocks, or off",
        "choices": ["hash", "radix", "off"]})
    # CUDA graphs.
    enforce_eager: bool = field(default=False, metadata={
        "help": "never capture CUDA graphs: every step launches its kernels one by one, as in stage 06"})
    # Speculative decoding.
    speculative: str = field(default="ngram", metadata={
        "help": "who guesses the next tokens for the model to check in one pass: n-gram prompt lookup, a draft "
                "model, or nobody", "choices": ["ngram", "draft", "off"]})
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "k: the most tokens guessed per sequence and step (the policy chooses 0 to k each step)"})
    speculative_policy: str = field(default="cost", metadata={
        "help": "how many guesses a sequence gets per step: those worth their rows, from the step's cost measured "
                "at start-up and the sequence's acceptance rate (cost), or always k (always)",
        "choices": ["cost", "always"]})
    step_costs: str = field(default="", metadata={
        "help": "with the cost policy: the step costs of a step_bench result file (NN_name_decode_steps.json) "
                "instead of timing steps at start-up, so that every start plans alike (the tests use one)"})
    draft_model: str = field(default="", metadata={
        "help": "with --speculative draft: a local Hugging Face folder with the model's tokenizer; none: the "
                "model's own first --draft-layers layers (a layer-skip draft)"})
    draft_layers: int = field(default=0, metadata={
        "help": "layers of the layer-skip draft; 0 is a third of the model's"})
    # Tensor parallelism.
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "N: ranks (processes, one GPU each on CUDA) that each hold 1/N of every layer; under torchrun, "
                "its number of processes"})
    dist_timeout: float = field(default=60.0, metadata={
        "help": "seconds a collective of the forward pass may wait for the other ranks before the engine stops"})
    process_group: bool = field(default=False, metadata={
        "help": "a process group even for one rank (gloo on a CPU, NCCL on CUDA): it issues every collective of a "
                "split engine, to test that path on one device; torchrun --nproc-per-node 1 does the same"})
    # Overlap scheduling.
    disable_overlap: bool = field(default=False, metadata={
        "help": "run every step synchronously, as in stage 09: schedule, run, read the tokens, then the next step "
                "(overlap launches step N + 1 before processing step N's tokens)"})
    device_thread: str = field(default="auto", metadata={
        "help": "on a CPU, run each step's device work (copy-in, forward pass, sampling) on a thread of its own, in "
                "launch order, as a GPU's stream does, so that the host's work overlaps it; off: each step computes "
                "inside its launch, and nothing overlaps; auto: off, as it was not reliably faster on a 2-core CPU "
                "(CUDA has its stream)",
        "choices": ["auto", "on", "off"]})
