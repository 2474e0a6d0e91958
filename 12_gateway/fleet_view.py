"""The gateway's view of its fleet, refreshed in the background, so that /health and /metrics never wait for it.

A liveness probe gives /health one or two seconds; a gateway that does not answer in time is taken for dead and
restarted, at its busiest moment if that is when it is slow. So /health must not wait for anything that a flood of
requests slows down. It used to ask Ray Serve's controller at every probe (``serve.status()`` on a thread), and in a
flood that call was both slow and costly: it builds a pydantic model of the whole Serve instance in the calling
process, serializing each deployment's request router class again on the way, and the probes queued for the
thread pool behind one another.

Here the gateway keeps a snapshot instead. Every ``REFRESH_S``, one task asks the controller for each model's
replicas and the settings it applies to the model's deployment; one task per model asks each of the model's replicas
for its engine's metrics (``EngineReport``). /health, /metrics and /fleet read the last snapshot as it is, await
nothing, and say how old it is. A refresh that fails leaves the last snapshot in place (its age grows); a slow one
delays only the next refresh of its kind, never a probe.

What a snapshot cannot do is let a probe jump the queue. A probe is an HTTP request like the others: it waits behind
them in Ray Serve's proxy and in the gateway's event loop (each request costs the gateway's ingress calls back to
the proxy, for its body and to learn when its client leaves). In a flood of thousands, that wait, not /health's own
work, is what a probe takes (``gateway_bench.py flood``): the probe port (probe_server.py) serves /health apart from
that path, from a FleetView of its own that a thread refreshes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from ray.serve.context import _get_global_client
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ReplicaState

from .gateway_messages import EngineReport

log = logging.getLogger("llm-course")
REFRESH_S = 1.0  # how often the snapshot is refreshed: the age a probe's answer may have, at most, when all is well


@dataclass(frozen=True)
class ModelFleet:
    """One model's deployment as the controller last described it."""

    replicas: dict[str, str]  # replica id -> its state (RUNNING, STARTING, STOPPING...)
    settings: dict[str, Any]  # what Ray Serve applies to the deployment (``settings_of``)

    def by_state(self) -> dict[str, int]:
        return dict(Counter(self.replicas.values()))


class FleetView:
    """The last snapshot of the fleet: each model's replicas and settings, each replica's engine report.

    ``deployments``: model -> its deployment's name; ``handles``: model -> its deployment's handle."""

    def __init__(self, deployments: dict[str, str], handles: dict[str, DeploymentHandle]) -> None:
        self.deployments = deployments
        self.handles = handles
        self.models: dict[str, ModelFleet] = {}  # empty until the first refresh
        self.taken: float | None = None  # time.monotonic() when ``models`` was read
        self.engines: dict[str, dict[str, EngineReport]] = {model: {} for model in handles}  # by model, by replica

    def watch(self) -> list[asyncio.Task[None]]:
        """Start refreshing, on the running event loop: the replicas and settings, and each model's engines. (Keep
        the tasks: the event loop holds only weak references to them.)"""
        refreshes = [self.refresh_models, *(functools.partial(self.refresh_engines, model) for model in self.handles)]
        return [asyncio.get_running_loop().create_task(every(REFRESH_S, refresh)) for refresh in refreshes]

    async def refresh_models(self) -> None:
        await asyncio.to_thread(self.read_models)  # a blocking call to the controller: off the event loop

    def read_models(self) -> None:
        """The replicas and settings of each model, read from the controller now (blocking)."""
        details = read_deployments()
        self.models = {model: ModelFleet(replicas_of(details[name]), settings_of(details[name]["deployment_config"]))
                       for model, name in self.deployments.items() if name in details}
        self.taken = time.monotonic()

    async def refresh_engines(self, model: str) -> None:
        """Every running replica's report. A broadcast bypasses the router's queue, but waits for a free slot in each
        replica (``max_ongoing_requests``): in a flood, until one of its requests ends."""
        answers = await self.handles[model].broadcast("report").results_async(return_exceptions=True)
        self.engines[model] = {answer.replica: answer for answer in answers if isinstance(answer, EngineReport)}

    def age_s(self) -> float | None:
        """Seconds since the replicas' states were read; None before the first time."""
        return None if self.taken is None else time.monotonic() - self.taken

    def replica_states(self, model: str) -> dict[str, int]:
        """The model's replicas by state, only the states that have one ({} before the first refresh)."""
        return self.models[model].by_state() if model in self.models else {}

    def reports(self, model: str) -> list[EngineReport]:
        """The model's engine reports, but none of a replica that the controller no longer lists (stopped, died)."""
        fleet = self.models.get(model)
        return [report for replica, report in self.engines[model].items() if fleet is None or replica in fleet.replicas]


async def every(seconds: float, refresh: Callable[[], Awaitable[None]]) -> None:
    """``refresh()`` forever, ``seconds`` after each one ends: a slow refresh delays the next, never piles them up."""
    while True:
        try:
            await refresh()
        except Exception as exc:  # a controller or replica that did not answer this time: the last snapshot stays
            log.warning("refreshing the fleet's view failed: %r", exc)
        await asyncio.sleep(seconds)


def read_deployments() -> dict[str, dict[str, Any]]:
    """Every deployment of every Serve application, by name, as the controller describes it (a dict in the schema of
    ``ray.serve.schema.DeploymentDetails``). Blocking: a call to the controller's process.

    Not ``serve.status()``, which asks the same and then builds it into pydantic models in the calling process:
    tens of milliseconds of CPU each time, with the GIL held, most of it serializing each deployment's request router
    class again. The dict costs this process almost nothing."""
    details = _get_global_client().get_serve_details()
    return {name: deployment for application in details["applications"].values()
            for name, deployment in application["deployments"].items()}


def replicas_of(deployment: dict[str, Any]) -> dict[str, str]:
    return {replica["replica_id"]: ReplicaState(replica["state"]).value for replica in deployment["replicas"]}


def settings_of(config: dict[str, Any]) -> dict[str, Any]:
    """The fleet's knobs (GatewayConfig's) for one model, as Ray Serve applies them to its deployment: read from
    the controller, they are what runs, whatever the command line said."""
    autoscaling = config.get("autoscaling_config") or {}
    policy = autoscaling.get("policy") or {}
    router = config.get("request_router_config") or {}
    actor = config.get("ray_actor_options") or {}
    return {
        "min_replicas": autoscaling.get("min_replicas"),
        "max_replicas": autoscaling.get("max_replicas"),
        "max_ongoing_requests": config.get("max_ongoing_requests"),
        "max_queued_requests": config.get("max_queued_requests"),
        "router": router.get("request_router_class"),
        "router_kwargs": router.get("request_router_kwargs"),
        "autoscaling_policy": policy.get("policy_function"),
        "autoscaling_policy_kwargs": policy.get("policy_kwargs"),
        **{key: autoscaling.get(key) for key in ("upscale_delay_s", "downscale_delay_s", "metrics_interval_s")},
        "replica_cpus": actor.get("num_cpus"),
        "replica_gpus": actor.get("num_gpus"),
    }


def gauge(report: EngineReport, name: str) -> float | None:
    """The value of an unlabelled metric in a replica's report (``llm_requests_running``...); None if it has none."""
    return next((sample.value for family in report.metrics if family.name == name for sample in family.samples), None)


class FleetCollector:
    """What /metrics shows of the fleet, read from the snapshot at each scrape (a prometheus_client collector): the
    replicas by state, the snapshot's age, and every replica's stage 11 metrics."""

    def __init__(self, view: FleetView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        yield self.replicas()
        if (age := self.view.age_s()) is not None:
            yield GaugeMetricFamily("llm_gateway_fleet_snapshot_age_seconds", "Seconds since the replicas' "
                                    "states were read from Ray Serve's controller (at most about 1 when all is well).",
                                    value=age)
        yield from engine_metrics((model, report) for model in self.view.handles for report in self.view.reports(model))

    def replicas(self) -> Metric:
        """Every state of every model, 0 when no replica is in it: a state that empties reads 0, not its last count."""
        family = GaugeMetricFamily("llm_gateway_replicas", "Replicas of a model, by state.", labels=["model", "state"])
        for model, fleet in self.view.models.items():
            counts = fleet.by_state()
            for state in ReplicaState:
                family.add_metric([model, state.value], counts.get(state.value, 0))
        return family


def engine_metrics(reports: Iterable[tuple[str, EngineReport]]) -> list[Metric]:
    """The replicas' families merged by name (one HELP and TYPE each, as a scrape expects), under stage 11's names,
    each sample labelled with its model and replica: ``sum by (model)`` gives the fleet's, per model."""
    merged: dict[str, Metric] = {}
    for model, report in reports:
        for family in report.metrics:
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples += [sample._replace(labels={"model": model, "replica": report.replica, **sample.labels})
                             for sample in family.samples]
    return list(merged.values())
