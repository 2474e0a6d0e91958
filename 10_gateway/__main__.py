"""python -m 10_gateway [--demo] [--large-model FOLDER|random-360m] [--router prefix|pow2] [--port P]

Starts Ray on this machine (or joins the cluster RAY_ADDRESS names), deploys one stage 09 engine per replica
of each model and the gateway in front of them, and serves the OpenAI API on --port until Ctrl-C.
"""

from __future__ import annotations

import json
import time

import httpx

from common.cli import add_config_args, config_from_args, model_dir_or_exit, stage_parser
from common.random_model import random_model_dir

from .config import EngineConfig
from .fleet import ModelSpec, model_specs, start, stop
from .gateway_config import RANDOM_LARGE, GatewayConfig

SYSTEM = ("You are a helpful assistant for a bicycle shop. Answer in one short sentence, politely, and never "
          "recommend a competitor. Our opening hours are 9 to 18 from Monday to Saturday.")


def large_folder(name: str) -> str | None:
    if not name:
        return None
    if name == RANDOM_LARGE:
        return str(random_model_dir(shape="360m"))
    return str(model_dir_or_exit(name))


def ask(client: httpx.Client, model: str, messages: list[dict[str, str]], max_tokens: int) -> httpx.Response:
    response = client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                         "max_tokens": max_tokens, "temperature": 0})
    if response.status_code != 200:
        raise SystemExit(f"error: {response.status_code} {response.text}")
    return response


def show(label: str, response: httpx.Response) -> None:
    answer = response.json()
    cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    print(f"\n{label}\n  -> model {response.headers['x-model']} ({response.headers['x-route']}), replica "
          f"{response.headers['x-replica']}, {answer['usage']['prompt_tokens']} prompt tokens of which {cached} "
          f"cached\n  {answer['choices'][0]['message']['content']!r}")


def demo(url: str, specs: list[ModelSpec], max_tokens: int) -> None:
    with httpx.Client(base_url=url, timeout=300) as client:
        show("An easy question, model 'auto':",
             ask(client, "auto", [{"role": "user", "content": "What is the capital of France?"}], max_tokens))
        if len(specs) > 1:
            show("A hard one, model 'auto' (the large model's text is noise if its weights are random):",
                 ask(client, "auto", [{"role": "user", "content": "Prove step by step that the square root of 2 "
                                       "is irrational, and explain why the proof works."}], max_tokens))
        for question in ("When are you open?", "Do you repair tyres?"):
            show(f"The shop's system prompt, then {question!r}:",
                 ask(client, specs[0].name, [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question}], max_tokens))
        print("\nWhere the requests went (the gateway's /metrics):")
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(("llm_gateway_requests_total", "llm_gateway_replicas")):
                print("  " + line)
        print("\n/health: " + json.dumps(client.get("/health").json()["models"]))


def main() -> None:
    parser = stage_parser(__package__, EngineConfig)
    add_config_args(parser, GatewayConfig)
    args = parser.parse_args()
    engine = config_from_args(EngineConfig, args)
    fleet = GatewayConfig(**{name: getattr(args, name) for name in GatewayConfig.__dataclass_fields__})
    if engine.device == "cuda" and fleet.replica_gpus == 0:
        raise SystemExit("error: --device cuda needs --replica-gpus (Ray hides the GPUs from replicas that ask for "
                         "none); e.g. --replica-gpus 0.25 --gpu-memory-utilization 0.2 for 4 replicas on one GPU")
    large = large_folder(fleet.large_model or (RANDOM_LARGE if args.demo else ""))
    specs = model_specs(engine, fleet, large)
    print(f"Models: {', '.join(f'{s.name} ({s.size}, {s.engine.model})' for s in specs)}")
    pinned = f" (the large model: {fleet.large_replicas})" if fleet.large_replicas and len(specs) > 1 else ""
    print(f"Replicas of each: {fleet.min_replicas} to {fleet.max_replicas}{pinned}, {fleet.replica_cpus} CPU each; "
          f"router: {fleet.router}; autoscaling past {fleet.target_queue_depth} waiting requests per replica")
    started = time.perf_counter()
    try:
        url = start(specs, fleet, args.host, args.port)
        print(f"The gateway serves {url} (started in {time.perf_counter() - started:.1f} s)")
        if args.demo:
            demo(url, specs, args.max_tokens)
            return
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop()


if __name__ == "__main__":
    main()
