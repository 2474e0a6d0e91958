"""/health on a port of its own, in the driver process: the probe path that a flood does not share.

The main port's /health answers from the fleet's snapshot, but a probe there is one HTTP request among the flood's:
it waits in Ray Serve's proxy (one asyncio process for every request) and in the gateway's event loop. In a flood of
3,000 on 2 cores that wait reached 15 s (``gateway_bench.py flood``), and a liveness probe of 1 s would restart a
gateway that is only busy. So the process that deployed the fleet (``python -m 12_gateway``) also serves /health
on ``--health-port``: a stdlib HTTP server in a thread, and a thread that refreshes a snapshot of its own from
Ray Serve's controller every ``REFRESH_S``. Neither touches the proxy or the ingress, so neither waits behind the
flood. Point a liveness probe here; the main port's /health stays, for load balancers and people.

Its answer has the same status (200, or 503 while a model has no running replica) and body as the main port's,
except ``in_flight``, which only the ingress counts: null here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .fleet_view import REFRESH_S, FleetView

log = logging.getLogger("llm-course")


def health_answer(view: FleetView, sizes: dict[str, str],
                  in_flight: dict[str, int] | None = None) -> tuple[dict[str, Any], int]:
    """/health's body and status, on either port: every model by its replicas' states (and, from the ingress, its
    requests in flight), 503 while one has no running replica."""
    models = {name: {"size": size, "replicas": view.replica_states(name),
                     "in_flight": None if in_flight is None else in_flight[name]} for name, size in sizes.items()}
    down = [name for name, state in models.items() if not state["replicas"].get("RUNNING")]
    status = f"no running replica of {', '.join(down)}" if down else "ok"
    return {"status": status, "models": models, "snapshot_age_s": view.age_s()}, 503 if down else 200


class ProbeServer:
    """/health (and /-/healthz, the same) on ``host:port`` from ``view``, in a daemon thread; ``view``'s replicas are
    read from the controller every REFRESH_S in another daemon thread."""

    def __init__(self, view: FleetView, sizes: dict[str, str], host: str, port: int) -> None:
        self.view, self.sizes = view, sizes
        self.stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path.split("?")[0] not in ("/health", "/-/healthz"):
                    body, status = {"error": "not found: this port serves /health only"}, 404
                else:
                    body, status = health_answer(server.view, server.sizes)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (quiet: a probe every second)
                pass

        self.http = ThreadingHTTPServer((host, port), Handler)
        self.http.daemon_threads = True
        self.url = f"http://{host}:{self.http.server_address[1]}"
        self.threads = [threading.Thread(target=self.http.serve_forever, name="probe-server", daemon=True),
                        threading.Thread(target=self.refreshing, name="probe-refresh", daemon=True)]
        for thread in self.threads:
            thread.start()

    def refreshing(self) -> None:
        while not self.stopping.is_set():
            try:
                self.view.read_models()
            except Exception as exc:  # the controller did not answer this time: the last snapshot stays
                log.warning("refreshing the probe port's view failed: %r", exc)
            self.stopping.wait(REFRESH_S)

    def close(self) -> None:
        self.stopping.set()
        self.http.shutdown()
        self.http.server_close()


def wait_first_snapshot(view: FleetView, timeout_s: float = 10.0) -> None:
    """Until the view has been read once (the fleet is up when this is called: its first read says so)."""
    deadline = time.monotonic() + timeout_s
    while view.taken is None and time.monotonic() < deadline:
        time.sleep(0.05)
