"""Autoscaling on queue depth: how many replicas of a model to run, from how many requests are waiting.

Utilization says nothing here: a continuous-batching engine is busy as soon as it has one request, and a
replica decoding 3 sequences reads the same 100% as one decoding 64 with 500 behind them. What tells that
a fleet is too small is the queue: requests that no batch holds yet. They wait in two places: in a
replica's scheduler (its ``waiting`` list, reported by the replica every ``metrics_interval_s``) and at
the gateway, in Ray Serve's router, when every replica already holds ``max_ongoing_requests``.

The policy is a Ray Serve custom autoscaling policy: Ray Serve calls it in its controller with what the
replicas reported, clamps its answer between ``min_replicas`` and ``max_replicas``, and applies it only
after it has held for ``upscale_delay_s`` (or ``downscale_delay_s``), which is what keeps a burst of a
second from starting a replica that takes several to load its model.
"""

from __future__ import annotations

import math
from typing import Any

from ray.serve.config import AutoscalingContext


def desired_replicas(current: int, waiting: float, running: float, target_depth: int, slots: int) -> int:
    """The replicas a model should have, before Ray Serve's bounds and delays.

    - Up, when more than ``target_depth`` requests per replica wait: one replica more for every ``slots``
      requests (what one new replica takes off the queue) of the excess, rounding up.
    - Down by one, when nothing waits and the sequences running would fit in half the slots of one
      replica fewer (the half keeps a fleet that has just drained from shrinking into a queue again).
    - Otherwise, as it is.
    """
    ### BEGIN SOLUTION 12.2
    excess = waiting - target_depth * current
    if excess > 0:
        return current + math.ceil(excess / slots)
    if waiting == 0 and current > 1 and running <= (current - 1) * slots / 2:
        return current - 1
    return current
    ### END SOLUTION


class QueueDepthPolicy:
    """The policy Ray Serve calls (``AutoscalingPolicy(policy_function=QueueDepthPolicy, policy_kwargs=...)``)."""

    def __init__(self, target_depth: int, slots: int) -> None:
        self.target_depth = target_depth
        self.slots = slots  # max_ongoing_requests: what one replica takes

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        reported = ctx.aggregated_metrics  # {"waiting": {replica: mean over the look-back window}, "running": ...}
        waiting = sum(reported.get("waiting", {}).values()) + (ctx.total_queued_requests or 0)
        running = sum(reported.get("running", {}).values())
        desired = desired_replicas(ctx.current_num_replicas, waiting, running, self.target_depth, self.slots)
        return desired, {"waiting": waiting, "running": running}
