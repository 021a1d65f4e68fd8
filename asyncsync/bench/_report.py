"""Benchmark output: machine description, markdown tables, JSON file, log-log plot."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["machine_info", "markdown", "write_json", "write_plot"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", "unknown"))


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git_state() -> str | None:
    """``<commit>`` of the asyncsync checkout, ``+dirty`` with uncommitted changes (None outside git)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", "asyncsync"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _mem_total_gib(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensordict": _version("tensordict"),
        "torchrl": _version("torchrl"),
        "asyncsync": _version("asyncsync"),
        "asyncsync_git": _git_state(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg": _loadavg(),
        "argv": sys.argv[1:],
    }


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if abs(value) >= 1 or value == 0:
            return f"{value:.{digits}f}"
        return f"{value:.3f}"
    return str(value)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def _cpu(total: Any, trainer: Any) -> str:
    """``total (trainer's part)`` in ms, e.g. ``0.581 (0.236)``."""
    if total is None:
        return "-" if trainer is None else f"- ({_f(trainer, 3)})"
    return f"{_f(total, 3)} ({_f(trainer, 3)})"


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i < 3 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown tables: latency rows, then memory rows and loop-lag rows when present."""
    parts: list[str] = []
    lat = [r for r in rows if r.get("kind", "latency") == "latency"]
    if lat:
        parts.append(
            _table(
                [
                    "transport",
                    "params",
                    "workers",
                    "median ms",
                    "p90 ms",
                    "GB/s",
                    "floor ms",
                    "x floor",
                    "x echo",
                    "x socket",
                    "x spin",
                    "CPU ms/send",
                    "trainer ms/worker",
                    "trainer CPU vs 1 worker",
                    "vs torchrl-mp",
                    "vs torchrl-shared",
                    "peak RSS sender MiB",
                    "peak RSS worker MiB",
                    "others' CPU %",
                ],
                [
                    [
                        r["transport"] + (" flat" if r.get("flat") else ""),
                        r["params"],
                        str(r["workers"]),
                        _f(r["median_ms"], 3),
                        _f(r["p90_ms"], 3),
                        _f(r["gbps"]),
                        _f(r["floor_ms"], 3),
                        _ratio(r["floor_ratio"]),
                        _ratio(r.get("echo_ratio")),
                        _ratio(r.get("socket_rtt_ratio")),
                        _ratio(r.get("spin_rtt_ratio")),
                        _cpu(r.get("cpu_ms_per_send"), r.get("trainer_cpu_ms_per_send")),
                        _f(r.get("trainer_cpu_ms_per_worker"), 3),
                        _ratio(r.get("trainer_cpu_vs_1w")),
                        _ratio(r.get("vs_torchrl_mp")),
                        _ratio(r.get("vs_torchrl_shared")),
                        _f(r.get("peak_rss_sender_mb")),
                        _f(r.get("peak_rss_worker_mb")),
                        _pct(r.get("other_cpu_pct")),
                    ]
                    for r in lat
                ],
            )
        )
    mem = [r for r in rows if r.get("kind") == "memory"]
    if mem:
        parts.append(
            f"Memory over {mem[0]['sends']} back-to-back sends (MiB; /dev/shm = bytes used there; memfd = resident asyncsync memfd mappings):\n\n"
            + _table(
                [
                    "transport",
                    "params",
                    "workers",
                    "median ms",
                    "sender RSS before -> after",
                    "sender peak (extra)",
                    "worker RSS first -> last",
                    "worker peak",
                    "/dev/shm before -> after",
                    "memfd sender before -> after",
                    "slots x size",
                ],
                [
                    [
                        r["transport"],
                        r["params"],
                        str(r["workers"]),
                        _f(r["median_ms"]),
                        f"{_f(r['rss_sender_before_mb'])} -> {_f(r['rss_sender_after_mb'])}",
                        f"{_f(r['peak_rss_sender_mb'])} (+{_f(r['sender_extra_mb'])})",
                        f"{_f(r['rss_worker_first_mb'])} -> {_f(r['rss_worker_last_mb'])}",
                        _f(r["peak_rss_worker_mb"]),
                        f"{_f(r['dev_shm_before_mb'])} -> {_f(r['dev_shm_after_mb'])}",
                        f"{_f(r['memfd_sender_before_mb'])} -> {_f(r['memfd_sender_after_mb'])}",
                        f"{r['slots']} x {_f(r['slots_mb'] / max(r['slots'], 1))}",
                    ]
                    for r in mem
                ],
            )
        )
    lag = [r for r in rows if r.get("kind") == "loop_lag"]
    if lag:
        parts.append(
            "Worker event-loop lag while updates land (1 ms ticker on the worker's loop; references: the same ticker while the trainer sleeps, and while it only perturbs and copies its weights without sending):\n\n"
            + _table(
                [
                    "mode",
                    "commit",
                    "params",
                    "workers",
                    "median send ms",
                    "send->commit ms",
                    "commit on loop ms",
                    "loop lag max ms",
                    "loop lag p99 ms",
                    "ref: idle max ms",
                    "ref: trainer copy only max ms",
                    "others' CPU %",
                ],
                [
                    [
                        r["mode"],
                        r["commit"],
                        r["params"],
                        str(r["workers"]),
                        _f(r["median_ms"]),
                        _f(r["send_to_commit_ms"]),
                        _f(r["worker_commit_ms"], 3),
                        _f(r["loop_lag_max_ms"]),
                        _f(r["loop_lag_p99_ms"]),
                        _f(r.get("loop_lag_idle_max_ms")),
                        _f(r.get("loop_lag_copy_max_ms")),
                        _pct(r.get("other_cpu_pct")),
                    ]
                    for r in lag
                ],
            )
        )
    return "\n\n".join(parts) + "\n"


def write_json(path: str, rows: Sequence[dict[str, Any]], machine: dict[str, Any] | None = None) -> None:
    with open(path, "w") as fh:
        json.dump({"machine": machine or machine_info(), "rows": list(rows)}, fh, indent=1)
        fh.write("\n")


#: The plot's text sizes (points): the legend and the axes' labels read at the size the docs show it.
PLOT_FONT = {"legend": 11.0, "ticks": 10.0, "labels": 11.0}


def write_plot(path: str, rows: Sequence[dict[str, Any]], machine: dict[str, Any] | None = None) -> None:
    """Median latency vs model size, log-log, one line per transport, one panel per worker
    count; one legend for all panels, below them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = [r for r in rows if r.get("kind", "latency") == "latency"]
    if not lat:
        raise ValueError("no latency rows to plot")
    worker_counts = sorted({r["workers"] for r in lat})
    def series(r: dict[str, Any]) -> str:  # a flattened model's rows are a line of their own
        return r["transport"] + (" flat" if r.get("flat") else "")

    transports = list(dict.fromkeys(map(series, lat)))
    markers = {"shm": "o", "queue": "s", "torchrl-mp": "^", "torchrl-shared": "v"}
    legend_cols = min(len(transports) + 1, 4)  # the transports and the floor
    legend_rows = math.ceil((len(transports) + 1) / legend_cols)
    height = 4.5 + 0.32 * legend_rows
    fig, axes = plt.subplots(1, len(worker_counts), figsize=(5.5 * len(worker_counts), height), sharey=True, squeeze=False)
    for ax, nw in zip(axes[0], worker_counts):
        for transport in transports:
            pts = sorted(
                (r["n_params"] * 4, r["median_ms"], r["p90_ms"])
                for r in lat
                if r["workers"] == nw and series(r) == transport
            )
            if not pts:
                continue
            x = [p[0] for p in pts]
            style = "--" if transport.endswith(" flat") else "-"
            ax.plot(x, [p[1] for p in pts], style, marker=markers.get(transport.removesuffix(" flat"), "o"), label=transport)
        floors: dict[int, float] = {}
        for r in lat:
            if r["workers"] == nw:
                floors[r["n_params"] * 4] = min(floors.get(r["n_params"] * 4, math.inf), r["floor_ms"])
        floor = sorted(floors.items())
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", lw=1, label="one-copy floor")
        labels = sorted({(r["n_params"] * 4, r["params"]) for r in lat if r["workers"] == nw})
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([b for b, _ in labels])
        ax.set_xticklabels([f"{s}\n{b / 2**20:.3g} MiB" for b, s in labels], fontsize=PLOT_FONT["ticks"])
        ax.tick_params(axis="y", labelsize=PLOT_FONT["ticks"])
        ax.minorticks_off()
        ax.set_xlabel("model size (float32 params)", fontsize=PLOT_FONT["labels"])
        ax.set_title(f"{nw} worker{'s' if nw > 1 else ''}", fontsize=PLOT_FONT["labels"])
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("send until all acks, median (ms)", fontsize=PLOT_FONT["labels"])
    # One legend for every panel, below them: each panel's lines, once.
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(
        list(handles.values()), list(handles), loc="lower center", ncol=legend_cols, fontsize=PLOT_FONT["legend"], frameon=False
    )
    info = machine or {}
    fig.suptitle(
        f"asyncsync vs torchrl weight sync — {info.get('cpu_model', '')}, {info.get('cores', '?')} cores, torch {info.get('torch', '')}",
        fontsize=PLOT_FONT["labels"],
    )
    fig.tight_layout(rect=(0.0, 0.075 * legend_rows * 4.5 / height, 1.0, 1.0))
    fig.savefig(path, dpi=120)
    plt.close(fig)
