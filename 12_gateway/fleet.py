"""The fleet as a Ray Serve application: one deployment per model (its replicas, its router, its autoscaling),
and the gateway in front of them.

``build_app`` only describes the application; ``start`` runs it on a local Ray instance (or on the cluster
``RAY_ADDRESS`` names), ``stop`` ends both. Nothing else in this stage starts a process: Ray places each
replica in a worker process of its own, restarts the ones that die, and adds or removes them as the
autoscaling policy says.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import ray
import torch
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from safetensors import safe_open

import common
from common.cli import served_name
from common.device import pick_dtype
from common.weights import resolve_model

from .autoscaling import QueueDepthPolicy
from .config import EngineConfig
from .fleet_view import FleetView
from .gateway import Gateway, ServedModel
from .gateway_config import GatewayConfig
from .prefix_router import PrefixAwareRouter
from .probe_server import ProbeServer, wait_first_snapshot
from .replica import ModelReplica
from .routing import DifficultyRule, Size

# Where the replicas' processes import this stage and `common` from (two places in a homework copy).
IMPORT_PATHS = os.pathsep.join(dict.fromkeys(str(Path(module).resolve().parent.parent)
                                             for module in (__file__, common.__file__)))
APP_NAME = "gateway"
# Ray waits 30 s for its node to register (a constant of its own, not a setting). On a laptop whose cores are busy it
# can miss that at the first start and make it at the second: one retry, then a message that says what to do.
RAY_START_TRIES = 2
RAY_BUSY_HINT = ("Ray's node did not start in time on this machine, twice: its cores are too busy (see `uptime`). "
                 "Close what else runs, or wait for it to finish, and start again")


class RayDidNotStart(RuntimeError):
    """Ray could not start its node here, at any of its tries."""
POW2_ROUTER = "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"  # Serve's default


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what clients put in "model"
    size: Size
    engine: EngineConfig  # its replicas' engine (engine.model: the folder)


def model_specs(engine: EngineConfig, fleet: GatewayConfig, large_folder: str | None) -> list[ModelSpec]:
    """The small model (``engine.model``) and, if there is one, the large one with the same engine settings."""
    specs = [ModelSpec(served_name(engine.model), "small", engine)]
    if large_folder:
        name = served_name(large_folder)
        if name == specs[0].name:  # two folders of the same name: tell them apart
            name += "-large"
        specs.append(ModelSpec(name, "large", replace(engine, model=large_folder)))
    return specs


def deployment_name(model: str) -> str:
    return "model-" + re.sub(r"[^A-Za-z0-9_-]", "-", model)


def replica_bounds(spec: ModelSpec, fleet: GatewayConfig) -> tuple[int, int]:
    """The fewest and the most replicas of one model."""
    if spec.size == "large" and fleet.large_replicas > 0:
        return fleet.large_replicas, fleet.large_replicas
    return fleet.min_replicas, fleet.max_replicas


def weight_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """What the weights of ``config``'s model take in ``dtype``, with those of its draft model's folder under
    ``--speculative draft`` (a layer-skip draft is the model's own layers): the elements their safetensors files
    hold, read from the files' headers alone."""
    folders = [config.model] + ([config.draft_model] if config.speculative == "draft" and config.draft_model else [])
    elements = 0
    for folder in folders:
        for path in resolve_model(folder).glob("*.safetensors"):
            with safe_open(path, "pt") as tensors:
                elements += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    return elements * dtype.itemsize


def shared_kv_cache_mb(total_bytes: int, share: float, utilization: float, weights: int) -> int:
    """The KV pool, in MiB, of a replica that holds ``share`` of a GPU of ``total_bytes``: ``utilization`` of
    its share, less its weights. Nothing here depends on what the other replicas hold, so the replicas can start
    in any order, or all at once. The rest of the share, ``1 - utilization`` of it, is for what the engine's own
    rule would have measured or left free: this process's CUDA context, the largest step's activations, the CUDA
    graphs."""
    budget = int(total_bytes * share * utilization) - weights
    if budget < 2**20:  # and never 0, which would mean "the engine's own rule" to the engine
        raise ValueError(f"--replica-gpus {share} of a {total_bytes / 2**30:.0f} GiB GPU at "
                         f"--gpu-memory-utilization {utilization} leaves no room for a KV cache beside "
                         f"{weights / 2**20:.0f} MiB of weights: give each replica more of the GPU or of its memory")
    return budget // 2**20


class GpuShareReplica(ModelReplica):
    """A replica on a fraction of a GPU (``--replica-gpus`` below 1), its KV pool sized to that fraction.

    Ray's fraction is bookkeeping: it places up to ``1 / share`` replicas on one GPU and shows each the whole
    card. The engine's own rule sizes its pool to ``gpu_memory_utilization`` of the whole card less all that is
    in use there, the other replicas' memory included, so the first replica to start would take its share of
    the whole card and a second would find nothing left. This replica gives the engine a fixed ``kv_cache_mb``
    instead, from its own share (``shared_kv_cache_mb``), before the engine starts."""

    def __init__(self, config: EngineConfig, served_name: str, threads: int, share: float) -> None:
        total = torch.cuda.get_device_properties(0).total_memory  # the GPU Ray gave this process: its cuda:0
        weights = weight_bytes(config, pick_dtype(config.dtype, torch.device("cuda")))
        kv_cache_mb = shared_kv_cache_mb(total, share, config.gpu_memory_utilization, weights)
        super().__init__(replace(config, kv_cache_mb=kv_cache_mb), served_name, threads)


def shares_a_gpu(engine: EngineConfig, fleet: GatewayConfig) -> bool:
    """Whether the gateway sizes the replicas' KV pools: replicas on a fraction of a GPU each, and no
    ``--kv-cache-mb`` (which, given, is every replica's pool as it is). A whole GPU or more is the replica's
    alone, and the engine's own rule is right there."""
    return 0 < fleet.replica_gpus < 1 and engine.device != "cpu" and engine.kv_cache_mb == 0


def model_deployment(spec: ModelSpec, fleet: GatewayConfig) -> Application:
    """One model's replicas: each a ModelReplica holding ``replica_cpus`` CPUs (and ``replica_gpus`` GPUs),
    routed and autoscaled."""
    if fleet.router == "prefix":
        router = RequestRouterConfig(request_router_class=PrefixAwareRouter,
                                     request_router_kwargs={"imbalance": fleet.router_imbalance})
    else:
        router = RequestRouterConfig(request_router_class=POW2_ROUTER)
    policy = AutoscalingPolicy(policy_function=QueueDepthPolicy, policy_kwargs={
        "target_depth": fleet.target_queue_depth, "slots": fleet.max_ongoing_requests})
    fewest, most = replica_bounds(spec, fleet)
    autoscaling = AutoscalingConfig(
        min_replicas=fewest, max_replicas=most, initial_replicas=fewest,
        metrics_interval_s=fleet.metrics_interval_s, look_back_period_s=max(1.0, 2 * fleet.metrics_interval_s),
        upscale_delay_s=fleet.upscale_delay_s, downscale_delay_s=fleet.downscale_delay_s, policy=policy)
    threads = max(1, math.ceil(fleet.replica_cpus))
    replica, args = ModelReplica, (spec.engine, spec.name, threads)
    if shares_a_gpu(spec.engine, fleet):
        replica, args = GpuShareReplica, (*args, fleet.replica_gpus)
    return serve.deployment(replica).options(
        name=deployment_name(spec.name), max_ongoing_requests=fleet.max_ongoing_requests,
        max_queued_requests=fleet.max_queued_requests,
        ray_actor_options={"num_cpus": fleet.replica_cpus, "num_gpus": fleet.replica_gpus},
        autoscaling_config=autoscaling, request_router_config=router,
        # A replica being removed takes no new request and has this long to finish its streams (long, on a CPU).
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=120.0,
    ).bind(*args)


def build_app(specs: list[ModelSpec], fleet: GatewayConfig) -> Application:
    models = [ServedModel(spec.name, spec.size, spec.engine.model, model_deployment(spec, fleet),
                          deployment_name(spec.name)) for spec in specs]
    rule = DifficultyRule(fleet.long_prompt_tokens, fleet.long_output_tokens, fleet.hard_prompt_score)
    return Gateway.bind(models, rule, specs[0].engine.block_size)


def cpus_needed(specs: list[ModelSpec], fleet: GatewayConfig) -> float:
    """The CPUs Ray must be told of for every model to reach its maximum."""
    return sum(replica_bounds(spec, fleet)[1] for spec in specs) * fleet.replica_cpus


PROBE_SERVERS: list[ProbeServer] = []  # the side ports that ``start`` opened, closed by ``stop``


def start(specs: list[ModelSpec], fleet: GatewayConfig, host: str = "127.0.0.1", port: int = 8012,
          health_port: int | None = None) -> str:
    """Start Ray (here, unless RAY_ADDRESS names a cluster), deploy the fleet, wait until every model has its
    minimum of replicas; the gateway's URL.

    On one machine, Ray is told of at least as many CPUs as the fleet may reserve: on a laptop the replicas
    then share its cores (the course's CPU measurements say what that costs); on a cluster, Ray's own
    count of each machine's CPUs (or GPUs) is what places replicas.

    With ``health_port``, /health is also served on that port, from this process (probe_server.py): the probe path
    that a flood of requests on ``port`` does not share."""
    if not ray.is_initialized():
        local = "RAY_ADDRESS" not in os.environ
        start_ray(max(os.cpu_count() or 1, math.ceil(cpus_needed(specs, fleet))) if local else None)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(specs, fleet), name=APP_NAME, route_prefix="/")
    if health_port is not None:
        start_probe_server(specs, host, health_port)
    return f"http://{host}:{port}"


def start_ray(num_cpus: int | None) -> None:
    """``ray.init`` on this machine (``num_cpus`` CPUs; None: join the cluster RAY_ADDRESS names), tried again once
    when its node misses Ray's start-up deadline; RayDidNotStart, with what to do, when it misses it twice."""
    for attempt in range(1, RAY_START_TRIES + 1):
        try:
            # address "local": a Ray instance of this process's own, never one that another program started here.
            ray.init(address="local" if num_cpus is not None else None, num_cpus=num_cpus, include_dashboard=False,
                     log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": IMPORT_PATHS}})
            return
        except Exception as exc:  # Ray raises a bare Exception when its node misses the deadline
            if "timed out" not in str(exc):
                raise
            ray.shutdown()  # what did start (its GCS, a raylet) goes before the next try
            if attempt == RAY_START_TRIES:
                raise RayDidNotStart(f"{RAY_BUSY_HINT} (Ray: {exc})") from exc
            print(f"Ray's node missed its start-up deadline (the machine is busy?): trying again ({exc})", flush=True)


def start_probe_server(specs: list[ModelSpec], host: str, port: int) -> ProbeServer:
    """/health on ``port``, from a snapshot this process refreshes itself (it needs no handle: replicas only)."""
    view = FleetView({spec.name: deployment_name(spec.name) for spec in specs}, {})
    server = ProbeServer(view, {spec.name: spec.size for spec in specs}, host, port)
    wait_first_snapshot(view)
    PROBE_SERVERS.append(server)
    return server


def stop() -> None:
    """The probe port, every replica, the gateway, Serve's controller and proxy, then Ray itself."""
    while PROBE_SERVERS:
        PROBE_SERVERS.pop().close()
    serve.shutdown()
    ray.shutdown()
