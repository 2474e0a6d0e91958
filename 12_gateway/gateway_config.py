"""Every knob of the fleet, in one place: which models, how many replicas of each, how requests are routed
and when the autoscaler adds or removes a replica.

The engine of every replica keeps its own knobs (``EngineConfig``, stage 11's, unchanged, ``quantization`` among
them); these are the gateway's. ``python -m 12_gateway --help`` has one flag per field of both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What the prefix router hashes: the first blocks of a prompt identify its system prompt and few-shot
# examples; past them, prompts differ anyway. 32 blocks of 16 tokens: the first 512 tokens.
ROUTING_BLOCKS = 32
RANDOM_LARGE = "random-360m"  # --large-model: a random-weight model with SmolLM2-360M's shapes, built offline


@dataclass
class GatewayConfig:
    # The models. The small one is --model (EngineConfig's); "auto" picks between the two.
    large_model: str = field(default="", metadata={
        "help": "a second, larger model behind the same endpoint (a local Hugging Face folder, or "
                f"{RANDOM_LARGE!r}: random weights with SmolLM2-360M's shapes and SmolLM2's tokenizer, whose text "
                "is noise); empty: one model, and 'auto' always picks it"})
    # Replicas: each one a whole stage 11 engine in its own process.
    min_replicas: int = field(default=1, metadata={"help": "replicas of each model the autoscaler never goes below"})
    max_replicas: int = field(default=2, metadata={"help": "replicas of each model the autoscaler never goes above"})
    large_replicas: int = field(default=0, metadata={
        "help": "a fixed number of replicas for the large model (a costly model, used less); 0: autoscaled "
                "between --min-replicas and --max-replicas like the small one"})
    replica_cpus: float = field(default=1.0, metadata={
        "help": "CPUs Ray reserves for each replica (fractions allowed); its PyTorch threads: this, rounded up"})
    replica_gpus: float = field(default=0.0, metadata={
        "help": "GPUs Ray gives each replica; a fraction shares one GPU (0.25: 4 replicas), and each replica's KV "
                "pool is then --gpu-memory-utilization of its fraction of the GPU's memory, less its weights "
                "(unless --kv-cache-mb sets it); 0: Ray hides the GPUs from the replicas, which run on CPUs"})
    max_ongoing_requests: int = field(default=96, metadata={
        "help": "requests one replica holds at once (its batch and a short queue); the rest wait at the gateway"})
    max_queued_requests: int = field(default=4096, metadata={
        "help": "requests that may wait at the gateway for each model; past it, 503 with Retry-After"})
    # Routing.
    router: str = field(default="prefix", metadata={
        "help": "how a replica is chosen: where the prompt's first blocks were sent before, unless that replica is "
                "too far ahead of another (prefix); or Ray Serve's default, the less loaded of two at random (pow2)",
        "choices": ["prefix", "pow2"]})
    router_imbalance: int = field(default=16, metadata={
        "help": "requests a replica may hold beyond the less loaded of two others and still get its prefixes"})
    long_prompt_tokens: int = field(default=512, metadata={
        "help": "'auto': a prompt at least this long goes to the large model (and keeps long jobs off the chats)"})
    long_output_tokens: int = field(default=512, metadata={
        "help": "'auto': a request that may generate at least this many tokens goes to the large model"})
    hard_prompt_score: int = field(default=2, metadata={
        "help": "'auto': a prompt with at least this many markers of reasoning ('prove', 'step by step', ...) goes "
                "to the large model"})
    # Autoscaling on queue depth.
    target_queue_depth: int = field(default=8, metadata={
        "help": "waiting requests per replica that the autoscaler tolerates; past it, it adds replicas"})
    upscale_delay_s: float = field(default=2.0, metadata={
        "help": "seconds the queue must stay too deep before replicas are added"})
    downscale_delay_s: float = field(default=20.0, metadata={
        "help": "seconds the queue must stay empty and the batches small before a replica is removed"})
    metrics_interval_s: float = field(default=0.5, metadata={
        "help": "how often each replica reports its queue to the autoscaler"})
