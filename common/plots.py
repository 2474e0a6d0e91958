"""The standard benchmark figure: four panels against concurrency, one line per result file (and the open
loop's, ``plot_rates``: latency and goodput against the offered rate).

End-to-end latency, inter-token latency, output tokens/s and requests in flight (with the engine's
busy fraction where the server reports it), each plotted against the concurrency level on a log2
axis, so that the stages of the course overlay on one picture. Latencies show the mean (solid) and
p99 (dotted). End-to-end latency is in seconds on a log scale: from one stage to the next it moves
by orders of magnitude (a request alone takes a few seconds; queued behind 63 others on a
one-at-a-time server, minutes), and on a linear axis the faster stage would lie flat along the bottom.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The Agg canvas draws to PNG without a display, and without pyplot's global state.
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

Result = dict[str, Any]
Level = dict[str, Any]


def load_result(result: Result | str | Path) -> Result:
    if isinstance(result, dict):
        return result
    return json.loads(Path(result).read_text())


def points(result: Result, value: Callable[[Level], float | None]) -> tuple[list[int], list[float]]:
    """(concurrency, value) for the levels that have a value."""
    pairs = [(level["concurrency"], value(level)) for level in result["levels"]]
    kept = [(c, v) for c, v in pairs if v is not None]
    return [c for c, _ in kept], [v for _, v in kept]


def latency(metric: str, stat: str, scale: float = 1000) -> Callable[[Level], float | None]:
    """A latency statistic of a level, multiplied by ``scale`` (1000: milliseconds, 1: seconds)."""
    def value(level: Level) -> float | None:
        stats = level[metric]
        return None if stats is None else scale * stats[stat]

    return value


def plot_latency(ax: Axes, results: list[Result], metric: str, title: str, unit: str = "ms") -> None:
    """Mean and p99 of ``metric`` per level, in ``unit`` ("ms" or "s")."""
    scale = {"ms": 1000, "s": 1}[unit]
    for i, result in enumerate(results):
        color = f"C{i}"
        xs, means = points(result, latency(metric, "mean", scale))
        if not xs:  # e.g. ITL of a server that does not stream: say so instead of drawing nothing
            ax.text(0.02, 0.95 - 0.07 * i, f"{result['name']}: not streamed, no {title.lower()}",
                    transform=ax.transAxes, color=color, va="top", fontsize=8)
            continue
        ax.plot(xs, means, "o-", color=color, label=f"{result['name']} mean")
        ax.plot(*points(result, latency(metric, "p99", scale)), ":", color=color, label=f"{result['name']} p99")
    ax.set_title(title)
    ax.set_ylabel({"ms": "ms", "s": "seconds"}[unit])


def plot_throughput(ax: Axes, results: list[Result]) -> None:
    for i, result in enumerate(results):
        ax.plot(*points(result, lambda level: level["output_tokens_per_s"]), "o-", color=f"C{i}",
                label=result["name"])
    ax.set_title("Output tokens/s")
    ax.set_ylabel("tokens/s")


def busy_percent(level: Level) -> float | None:
    """The engine's busy fraction in percent; None for a server (or an older result) that has none."""
    busy = level.get("engine_busy")
    return None if busy is None else 100 * busy


def plot_in_flight(ax: Axes, results: list[Result]) -> None:
    """Mean in-flight count per level (a server-side count shows how many the server really held) and, on
    the right axis, the engine's busy fraction (dashed), for the servers that report it (stages 02 on).

    The busy fraction is what a GPU-utilization panel shows: the share of time the engine was computing.
    Busy is not efficient: a one-at-a-time server is busy all the time and still serves one request."""
    busy_ax = None
    for i, result in enumerate(results):
        sources = {level["in_flight"]["source"] for level in result["levels"]}
        label = result["name"] + ("" if sources == {"server"} else " (client-side count)")
        ax.plot(*points(result, lambda level: level["in_flight"]["mean"]), "o-", color=f"C{i}", label=label)
        xs, busy = points(result, busy_percent)
        if xs:
            busy_ax = busy_ax or ax.twinx()
            busy_ax.plot(xs, busy, "s--", color=f"C{i}", alpha=0.6, label=f"{result['name']} engine busy")
    ax.set_title("Requests in flight (mean); engine busy % (dashed)")
    ax.set_ylabel("requests")
    if busy_ax is not None:
        busy_ax.set_ylim(0, 105)
        busy_ax.set_ylabel("engine busy (% of wall time)")


def subtitle(results: list[Result]) -> str:
    first = results[0]
    workload = first["workload"]
    return (f"{first['model']} on {first['device']} ({first['dtype']}), {workload['requests_per_level']} requests "
            f"per level, {workload['max_tokens']} output tokens each, greedy")


def plot_results(results: Sequence[Result | str | Path], out: str | Path) -> Path:
    """Draw the 4-panel figure for one or more results (dicts or JSON paths) into the PNG ``out``."""
    loaded = [load_result(r) for r in results]
    fig = Figure(figsize=(12, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    e2e, itl, tps, in_flight = fig.subplots(2, 2).flat
    plot_latency(e2e, loaded, "e2e_s", "End-to-end latency (log scale)", unit="s")
    e2e.set_yscale("log")
    e2e.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 0.1, 1, 10, not 10^-1, 10^0...
    plot_latency(itl, loaded, "itl_s", "Inter-token latency")
    plot_throughput(tps, loaded)
    plot_in_flight(in_flight, loaded)
    levels = sorted({level["concurrency"] for r in loaded for level in r["levels"]})
    for ax in (e2e, itl, tps, in_flight):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        if ax.get_yscale() == "linear":
            ax.set_ylim(bottom=0)  # a zoomed axis would make small changes look large
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(" vs ".join(r["name"] for r in loaded) + "\n" + subtitle(loaded), fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def rate_points(result: Result, value: Callable[[Level], float | None]) -> tuple[list[float], list[float]]:
    """(offered rate, value) for the rates of an open-loop result that have a value."""
    kept = [(rate["rate"], v) for rate in result["rates"] if (v := value(rate)) is not None]
    return [r for r, _ in kept], [v for _, v in kept]


def rates_subtitle(result: Result) -> str:
    workload, slo = result["workload"], result["slo"]
    cap = "" if workload["max_concurrency"] is None else f", at most {workload['max_concurrency']} in flight"
    return (f"{result['model']} on {result['device']} ({result['dtype']}), {workload['requests_per_rate']} requests "
            f"per rate, {workload['arrivals']} arrivals{cap}, {workload['max_tokens']} output tokens each; SLO: TTFT "
            f"{slo['ttft_ms']:g} ms, ITL {slo['itl_ms']:g} ms (a request's mean gap), met by {100 * slo['share']:g}%")


def plot_rates(results: Sequence[Result | str | Path], out: str | Path) -> Path:
    """The open loop's figure, one curve per result (dicts or JSON paths), against the offered rate: TTFT p50
    (solid) and p90 (dashed) on a log scale, ITL p50, and the share of requests that met both SLOs. The
    first result's SLOs are the grey horizontal lines; each result's sustainable rate is a dotted vertical
    line in its colour. Where the TTFT curves turn upward is the knee: the rate at which requests start to
    queue faster than the server drains them."""
    loaded = [load_result(r) for r in results]
    fig = Figure(figsize=(15, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ttft, itl, share = fig.subplots(1, 3)
    for i, result in enumerate(loaded):
        color, name = f"C{i}", result["name"]
        ttft.plot(*rate_points(result, latency("ttft_s", "p50")), "o-", color=color, label=f"{name} p50")
        ttft.plot(*rate_points(result, latency("ttft_s", "p90")), "--", color=color, label=f"{name} p90")
        itl.plot(*rate_points(result, latency("itl_s", "p50")), "o-", color=color, label=f"{name} p50")
        share.plot(*rate_points(result, lambda rate: 100 * rate["goodput_share"]), "o-", color=color, label=name)
        if (sustainable := result["sustainable_rate"]) is not None:
            for ax in (ttft, itl, share):
                ax.axvline(sustainable, color=color, linestyle=":", alpha=0.8)
            share.plot([], [], ":", color=color, label=f"{name}: sustains {sustainable:g}/s")
    slo = loaded[0]["slo"]
    for ax, target, label in ((ttft, slo["ttft_ms"], "TTFT SLO"), (itl, slo["itl_ms"], "ITL SLO"),
                              (share, 100 * slo["share"], "required share")):
        ax.axhline(target, color="0.4", linestyle="-.", linewidth=1, label=f"{label} ({target:g})")
    ttft.set(title="Time to first token (log scale)", ylabel="ms", yscale="log")
    for axis_formatter in (ttft.yaxis.set_major_formatter, ttft.yaxis.set_minor_formatter):
        axis_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 200, 300, not 2 x 10^2
    itl.set(title="Inter-token latency (p50 of requests' mean gaps)", ylabel="ms")
    share.set(title="Requests that met both SLOs", ylabel="% of requests")
    itl.set_ylim(bottom=0)
    share.set_ylim(0, 105)
    rates = sorted({rate["rate"] for result in loaded for rate in result["rates"]})
    for ax in (ttft, itl, share):
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{rate:g}" for rate in rates])
        ax.set_xlabel("offered rate (requests/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    names = [r["name"].removesuffix("_rates") for r in loaded]
    title = " vs ".join(names) if len(names) <= 2 else f"{names[0]} to {names[-1]}"  # each one is in the legends
    fig.suptitle(f"{title}: latency against the offered rate\n" + rates_subtitle(loaded[0]), fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def plot_request_timeline(ax: Axes, level: Level, title: str, max_requests: int = 16) -> None:
    """One bar per request of a level, as the client saw it: grey while it waited for its first
    token (queueing and prefill), coloured while tokens streamed in. Without streaming the whole
    answer arrives at the end, so the bar is all grey."""
    records = sorted((r for r in level["records"] if r["ok"]), key=lambda r: r["start_s"])[:max_requests]
    for row, record in enumerate(records):
        start, first, end = record["start_s"], record["start_s"] + record["ttft_s"], record["start_s"] + record["e2e_s"]
        ax.barh(row, first - start, left=start, color="0.75")
        ax.barh(row, end - first, left=first, color="C1")
    ax.set_yticks(range(len(records)), [f"#{r['index']}" for r in records])
    ax.invert_yaxis()  # the first request on top
    ax.set_xlabel("seconds since the level started")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)


SPAN_COLORS = {"tokenize": "C4", "queued": "0.8", "prefill": "C3", "decode": "C0", "detokenize": "C2", "send": "C1"}


def plot_traces(ax: Axes, traces: list[dict[str, Any]], title: str) -> None:
    """One row per request (from ``--trace``), its spans on the server's clock: grey while it waited,
    red for its prefill, blue for each decode step, and the thin slivers of the HTTP side's and the
    detokenizer's work between them."""
    start = min(trace["origin_s"] for trace in traces)
    ordered = sorted(traces, key=lambda trace: trace["origin_s"])
    for row, trace in enumerate(ordered):
        offset_ms = 1000 * (trace["origin_s"] - start)
        for name, span_start, duration in trace["spans"]:
            ax.barh(row, duration, left=offset_ms + span_start, color=SPAN_COLORS[name], height=0.6,
                    edgecolor="white" if name == "decode" else None, linewidth=0.3)
    ax.set_yticks(range(len(ordered)), [trace["request_id"][-8:] for trace in ordered])
    ax.invert_yaxis()  # the first request on top
    ax.set_xlabel("ms on the server's clock")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=color, label=name) for name, color in SPAN_COLORS.items()], fontsize=8,
              ncols=len(SPAN_COLORS), loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)


# The phases of a step (common/trace.py's StepClock), what is left of the server's ITL outside the step, and what
# the client waited beyond the server.
PHASE_COLORS = {"decode step": "tab:blue", "schedule": "tab:olive", "propose": "tab:cyan", "prepare": "tab:orange",
                "sample": "tab:green", "verify": "tab:green", "update": "tab:purple", "detokenize": "tab:pink",
                "handoff": "tab:brown", "outside the step": "tab:gray", "to the client": "lightgray"}


def token_time_parts(level: Level) -> dict[str, float]:
    """A level's mean time between two tokens, in ms, cut into parts: the forward pass of a decode step, each other
    phase of a mean step, what is left of the server's own ITL outside the engine's step (the thread's loop, waiting
    for the GIL), and what the client waited beyond the server's ITL (the chunk written out, the network, the
    client's parsing). Empty for a level without phases (stages 01 to 03)."""
    phases, itl = level.get("step_phases_ms"), level.get("itl_s")
    if not phases or level.get("decode_step_ms") is None or level.get("server_itl_ms") is None or itl is None:
        return {}
    parts = {"decode step": level["decode_step_ms"]}
    parts |= {name: ms for name, ms in phases.items() if name != "execute"}
    parts["outside the step"] = max(0.0, level["server_itl_ms"] - sum(parts.values()))
    parts["to the client"] = max(0.0, 1000 * itl["mean"] - sum(parts.values()))
    return parts


def plot_token_time(ax: Axes, results: Sequence[Result], concurrencies: Sequence[int]) -> None:
    """One stacked bar per (result, concurrency): where a token's time went, from ``token_time_parts``."""
    labels, bars = [], []
    for result in results:
        for level in result["levels"]:
            if level["concurrency"] in concurrencies and (parts := token_time_parts(level)):
                labels.append(f"{result['name']}\nc = {level['concurrency']}")
                bars.append(parts)
    for i, parts in enumerate(bars):
        bottom = 0.0
        for name, ms in parts.items():
            ax.bar(i, ms, bottom=bottom, color=PHASE_COLORS.get(name, "black"), width=0.6)
            bottom += ms
        server = bottom - parts["to the client"]
        ax.text(i, bottom, f"{bottom:.0f} ms\nnot the model:\n{100 * (1 - parts['decode step'] / server):.0f}% at the "
                f"server,\n{100 * (1 - parts['decode step'] / bottom):.0f}% at the client", ha="center", va="bottom",
                fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("ms between two tokens (mean ITL)")
    ax.set_title("Where a token's time goes: the model's decode step, and the server's own time")
    shown = {name for parts in bars for name in parts}
    ax.legend(handles=[Patch(color=color, label=name) for name, color in PHASE_COLORS.items() if name in shown],
              fontsize=8, loc="upper left")
    ax.margins(y=0.15)


def plot_mixed(result: Result, out: str | Path) -> Path:
    """The mixed workload (common/mixed.py), in two panels. Left: every gap between two tokens of a chat stream,
    over the run, for the stage without a token budget and for stage 06 at the budget nearest 256 (grey lines:
    a long prompt arrives; shaded: the lead-in before the measured window). Right: the budget's trade-off, the
    chat streams' p99 gap against the long prompts' mean time to first token, one point per budget, the stage
    without a budget as a star."""
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    timeline, tradeoff = fig.subplots(1, 2)
    runs = result["runs"]
    unchunked = [run for run in runs if run["budget"] is None]
    chunked = sorted((run for run in runs if run["budget"] is not None), key=lambda run: run["budget"])
    shown = unchunked[:1] + ([min(chunked, key=lambda run: abs(run["budget"] - 256))] if chunked else [])
    for run in shown:
        when, gaps = zip(*run["chat_gaps"], strict=True)
        timeline.scatter(when, [1000 * gap for gap in gaps], s=4, alpha=0.5, label=run["label"])
    for sent, _ in shown[0]["long_ttfts"] if shown else []:
        timeline.axvline(sent, color="grey", linewidth=0.8, alpha=0.6)
    if shown and "window" in shown[0]:
        timeline.axvspan(0, shown[0]["window"][0], color="grey", alpha=0.1)  # the lead-in: not in the summary
    timeline.set(yscale="log", xlabel="seconds into the run", ylabel="gap between two tokens of a chat stream (ms)",
                 title="Chat streams while long prompts arrive (grey; shaded: lead-in)")
    timeline.legend(markerscale=4)
    if chunked:
        x = [run["long_ttft_s"]["mean"] for run in chunked]
        y = [1000 * run["chat_itl_s"]["p99"] for run in chunked]
        tradeoff.plot(x, y, marker="o", label=f"{chunked[0]['label'].split(' ')[0]}, by budget")
        for run, xi, yi in zip(chunked, x, y, strict=True):
            tradeoff.annotate(str(run["budget"]), (xi, yi), textcoords="offset points", xytext=(5, 5))
    for run in unchunked:
        tradeoff.scatter([run["long_ttft_s"]["mean"]], [1000 * run["chat_itl_s"]["p99"]], marker="*", s=150,
                         color="C3", label=f"{run['label']} (no budget)")
    tradeoff.set(yscale="log", xlabel="long prompts: mean time to first token (s)",
                 ylabel="chat streams: p99 gap between tokens (ms)", title="The budget's trade-off")
    tradeoff.legend()
    fig.suptitle(f"Mixed workload: {result['workload']['streams']} chat streams, a "
                 f"{result['workload']['long_tokens'][0]}-{result['workload']['long_tokens'][1]}-token prompt every "
                 f"{result['workload']['long_every_s']:g} s ({result['device']}, {result['machine'].get('cpu', '')})")
    fig.savefig(out, dpi=110)
    return Path(out)
