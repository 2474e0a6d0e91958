"""Prometheus metrics, served at GET /metrics. Each server gets its own registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

if TYPE_CHECKING:
    from .stats import EngineStats

disable_created_metrics()  # no *_created series: they only add noise to a course server's output

# Seconds. Fine at the low end: a decode step of a small model takes a few milliseconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Short events: from a few microseconds (writing one event out, one phase of a step) to a CPU's forward pass.
PHASE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("llm_requests_running", "Requests the engine is generating for.", registry=r)
        self.waiting = Gauge("llm_requests_waiting", "Requests queued, not started yet.", registry=r)
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("llm_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llm_inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=LATENCY_BUCKETS, registry=r)
        # Busy is not efficient: a step of one sequence counts as much as a step of 64.
        self.engine_busy = Counter("llm_engine_busy_seconds", "Seconds the engine core spent computing "
                                   "(not waiting for work); its rate is the engine's busy fraction.", registry=r)
        # Where a token's time goes: the model's (execute) and the server's own (every other phase).
        self.step_phase = Histogram("llm_step_phase_seconds", "Time of each phase of an engine turn: schedule, "
                                    "propose, prepare, launch (the step queued on the device), read (the wait for "
                                    "the tokens of the step launched a turn before), verify, update, detokenize, and "
                                    "handoff (its outputs sent through the core's pipe and passed to the event "
                                    "loop).", ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.decode_step = Histogram("llm_decode_step_seconds", "The device's time for each step (CUDA events, or the "
                                     "CPU's device thread), once for each sequence that decoded in it: its mean is "
                                     "the model's part of an inter-token latency.", buckets=PHASE_BUCKETS, registry=r)
        self.stream_write = Histogram("llm_stream_write_seconds", "Time the event loop took to write one streamed "
                                      "event out (server-sent events).", buckets=PHASE_BUCKETS, registry=r)

        self.preemptions = Counter("llm_preemptions", "Sequences preempted (blocks taken back, to be recomputed).",
                                   registry=r)
        self.kv_blocks_used = Gauge("llm_kv_blocks_used", "KV-cache blocks held by sequences.", registry=r)
        self.kv_blocks_free = Gauge("llm_kv_blocks_free", "KV-cache blocks on the free list.", registry=r)
        # The prefix cache, counted in tokens as vLLM does: hits / queries is the hit rate.
        self.prefix_cache_queries = Counter("llm_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache at admission.", registry=r)
        self.prefix_cache_hits = Counter("llm_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                         "(not computed again).", registry=r)
        self.kv_blocks_cached = Gauge("llm_kv_blocks_cached", "KV-cache blocks in the prefix cache (shared or "
                                      "evictable).", registry=r)
        self.kv_blocks_evictable = Gauge("llm_kv_blocks_evictable", "KV-cache blocks no sequence holds that the "
                                         "prefix cache still finds (reused last, least recently used first).",
                                         registry=r)

        # Speculative decoding: accepted / proposed is the acceptance rate.
        self.spec_proposed_tokens = Counter("llm_spec_proposed_tokens", "Guessed tokens checked by the model.",
                                            registry=r)
        self.spec_accepted_tokens = Counter("llm_spec_accepted_tokens", "Guessed tokens the model agreed with (each "
                                            "one a token without a step of its own).", registry=r)
        self.spec_accepted_length = Histogram("llm_spec_accepted_length", "Guesses kept per verification (a "
                                              "sequence's step that brought guesses); the step emits one more.",
                                              buckets=tuple(range(9)), registry=r)
        self.spec_acceptance_rate = Gauge("llm_spec_acceptance_rate", "Accepted over proposed guesses, since "
                                          "start-up.", registry=r)

        # Overlap scheduling: the steps launched while the step before was in flight, and those that could not be.
        self.overlapped_steps = Counter("llm_overlapped_steps", "Steps launched before the step in flight was "
                                        "processed: the host's work for one ran while the device computed the other.",
                                        registry=r)
        self.sync_steps = Counter("llm_sync_steps", "Steps that waited for the step before them, by reason: "
                                  "speculation, penalties, tensor_parallel, prompt_logprobs.", ["reason"], registry=r)

    def watch(self, stats: Callable[[], EngineStats]) -> None:
        """Read the queue lengths and block counts when /metrics is scraped, from the engine's last snapshot."""
        self.running.set_function(lambda: stats().running)
        self.waiting.set_function(lambda: stats().waiting)
        self.kv_blocks_used.set_function(lambda: stats().kv_blocks.used)
        self.kv_blocks_free.set_function(lambda: stats().kv_blocks.free)
        self.kv_blocks_cached.set_function(lambda: stats().kv_blocks.cached)
        self.kv_blocks_evictable.set_function(lambda: stats().kv_blocks.evictable)
        self.spec_acceptance_rate.set_function(lambda: stats().speculation.acceptance_rate)

    def observe_step(self, phases: dict[str, float], device_seconds: float, num_decoding: int) -> None:
        """One turn's phases, in seconds (``StepClock.phases``); and the device's time for the step it read, once for
        each sequence that waited for that step between two of its tokens (a token-weighted mean, as the ITL's is: a
        step of 64 counts 64 times)."""
        for phase, seconds in phases.items():
            self.step_phase.labels(phase).observe(seconds)
        for _ in range(num_decoding):
            self.decode_step.observe(device_seconds)

    def count(self, before: EngineStats, after: EngineStats) -> None:
        """Move the counters by what the engine counted between two of its snapshots."""
        self.preemptions.inc(after.preemptions - before.preemptions)
        self.prefix_cache_queries.inc(after.prefix_cache.queries - before.prefix_cache.queries)
        self.prefix_cache_hits.inc(after.prefix_cache.hits - before.prefix_cache.hits)
        self.spec_proposed_tokens.inc(after.speculation.proposed - before.speculation.proposed)
        self.spec_accepted_tokens.inc(after.speculation.accepted - before.speculation.accepted)
        self.overlapped_steps.inc(after.overlap.overlapped - before.overlap.overlapped)
        for reason, steps in after.overlap.synchronous.items():
            self.sync_steps.labels(reason).inc(steps - before.overlap.synchronous.get(reason, 0))

    def count_verifications(self, accepted_lengths: list[int]) -> None:
        """One step's verifications: the guesses each kept."""
        for length in accepted_lengths:
            self.spec_accepted_length.observe(length)

    def render(self) -> bytes:
        return generate_latest(self.registry)
