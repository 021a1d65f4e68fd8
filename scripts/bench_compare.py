"""Compare checkouts of asyncsync with the bench, in one run, alternating between them.

Each round runs ``python -m asyncsync.bench`` once from each source tree (the order
rotates every round, so a machine that gets busier or quieter during the run favours
none), then the rows of all trees are printed side by side: the median over the rounds of
each row's median latency and of the trainer's CPU per send, and each tree's ratio to the
first (A). Multi-host rows get a second table: the CPU the hosts (relays and their
workers) spent per send, and the send over a raw gloo broadcast. On a shared or noisy
machine, read the ratios (the CPU ones first), and use several rounds.

Example (the previous release against your working copy)::

    git worktree add --detach ../asyncsync-prev v0.3.0
    python scripts/bench_compare.py ../asyncsync-prev . --rounds 4 -- \\
        --transports shm --params 10k,1M/256 --workers 1,2 --repeats 300

Everything after ``--`` goes to the bench of every tree; a flag that one tree's bench
does not know (an older release) is left out for that tree, and said so. With
``--harness TREE``, every tree's library is measured by TREE's bench code (its
``asyncsync/bench``), so that an older tree gets the same measurements (the CPU columns
of multi-host rows, for example), as long as its public API runs that code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Flags this script sets itself, and flags that only take the bench's time (not latency rows).
_OWN = ("--json", "--plot")
_QUIET = ("--no-echo", "--no-floors", "--no-memory")


def _known_flags(tree: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "asyncsync.bench", "--help"], cwd=tree, env=_env(tree), capture_output=True, text=True, check=True
    )
    return out.stdout


@contextmanager
def _overlay(lib: Path, harness: Path | None) -> Iterator[Path]:
    """A source tree whose ``asyncsync`` is *lib*'s, with *harness*'s ``asyncsync/bench``
    (links in a temporary folder); *lib* itself without a harness."""
    if harness is None or harness == lib:
        yield lib
        return
    with tempfile.TemporaryDirectory(prefix="bench-overlay-") as tmp:
        pkg = Path(tmp) / "asyncsync"
        pkg.mkdir()
        for entry in (lib / "asyncsync").iterdir():
            if entry.name not in ("bench", "__pycache__"):
                (pkg / entry.name).symlink_to(entry.resolve())
        (pkg / "bench").symlink_to((harness / "asyncsync" / "bench").resolve())
        yield Path(tmp)


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _args_for(tree: Path, args: list[str], help_text: str) -> list[str]:
    """*args* less the flags (and their values) that *tree*'s bench does not accept."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag = arg.split("=", 1)[0]
        takes_value = "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("--")
        if flag.startswith("--") and flag not in help_text:
            print(f"note: {tree}: its bench has no {flag}; left out", file=sys.stderr)
            i += 2 if takes_value else 1
            continue
        out.append(arg)
        i += 1
    return out


def _run(tree: Path, args: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "asyncsync.bench", *args, "--json", str(out)]
        print(f"$ (cd {tree} && {' '.join(cmd[1:])})", file=sys.stderr)
        subprocess.run(cmd, cwd=tree, env=_env(tree), check=True, stdout=subprocess.DEVNULL)
        rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    return [r for r in rows if r.get("kind", "latency") == "latency"]


Key = tuple[str, str, str, bool]


def _key(row: dict[str, Any]) -> Key:
    if "workers_per_host" in row:  # a dist-gloo row
        workers = f"{row['hosts']} x {row['workers_per_host']}"
    else:
        workers = str(row["workers"])
    return (row["transport"], row["params"], workers, bool(row.get("flat", False)))


def _latency(row: dict[str, Any]) -> float | None:
    return row.get("median_ms", row.get("send_median_ms"))


# (column title, how to read it from a row); the dist-only metrics go to the second table.
_METRICS: dict[str, Any] = {
    "median_ms": _latency,
    "trainer": lambda r: r.get("trainer_cpu_ms_per_send"),
    "hosts": lambda r: r.get("hosts_cpu_ms_per_send"),
    "x_raw": lambda r: r.get("x_raw"),
}


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(b: float | None, a: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None else "-"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def compare(trees: list[Path], bench_args: list[str], rounds: int, harness: Path | None = None) -> dict[str, Any]:
    """Run every tree's bench *rounds* times, rotating the order; return every row of every round."""
    runs: dict[Path, list[list[dict[str, Any]]]] = {t: [] for t in trees}
    for r in range(rounds):
        k = r % len(trees)
        for tree in trees[k:] + trees[:k]:
            with _overlay(tree, harness) as src:
                runs[tree].append(_run(src, _args_for(tree, bench_args, _known_flags(src))))
    return {
        "trees": [str(t) for t in trees],
        "harness": None if harness is None else str(harness),
        "bench_args": bench_args,
        "rounds": {str(t): rs for t, rs in runs.items()},
    }


def table(result: dict[str, Any]) -> str:
    """The markdown tables: per row, medians over the rounds for each tree, and each over A."""
    trees: list[str] = result["trees"] if "trees" in result else [result["a"], result["b"]]
    names = [chr(ord("A") + i) for i in range(len(trees))]
    per: dict[str, dict[Key, dict[str, list[float | None]]]] = {t: {} for t in trees}
    order: list[Key] = []
    for tree in trees:
        for rows in result["rounds"][tree]:
            for row in rows:
                k = _key(row)
                if k not in order:
                    order.append(k)
                cell = per[tree].setdefault(k, {m: [] for m in _METRICS})
                for m, read in _METRICS.items():
                    cell[m].append(read(row))
    keys = [k for k in order if all(k in per[t] for t in trees)]

    def columns(metric: str, title: str, fmt: Any) -> tuple[list[str], list[list[str]]]:
        heads = [f"{names[0]} {title}"]
        for n in names[1:]:
            heads += [f"{n} {title}", f"{n} / {names[0]}"]
        body = []
        for k in keys:
            vals = [_median(per[t][k][metric]) for t in trees]
            cells = [fmt(vals[0])]
            for v in vals[1:]:
                cells += [fmt(v), _ratio(v, vals[0])]
            body.append(cells)
        return heads, body

    def render(metrics: list[tuple[str, str, Any]], only: list[Key]) -> list[str]:
        heads = ["transport", "params", "workers"]
        bodies: list[list[str]] = [[k[0] + (" (flat)" if k[3] else ""), k[1], k[2]] for k in keys]
        for metric, title, fmt in metrics:
            h, b = columns(metric, title, fmt)
            heads += h
            for row, cells in zip(bodies, b):
                row += cells
        lines = ["| " + " | ".join(heads) + " |", "|---|---|---|" + "---:|" * (len(heads) - 3)]
        lines += ["| " + " | ".join(row) + " |" for k, row in zip(keys, bodies) if k in only]
        return lines

    rounds = len(result["rounds"][trees[0]])
    lines = ["  ".join(f"{n}: {t}" for n, t in zip(names, trees)) + f"  ({rounds} rounds each, rotating; medians over the rounds)"]
    if result.get("harness"):
        lines.append(f"(every tree measured by the bench code of {result['harness']})")
    lines += ["", *render([("median_ms", "median ms", _ms), ("trainer", "trainer CPU ms/send", _ms)], keys)]
    dist = [k for k in keys if k[0].startswith("dist")]
    if dist:
        lines += [
            "",
            "Multi-host rows (workers: hosts x workers per host): the hosts' CPU per send (relays and their workers), "
            "and the send over a raw gloo broadcast of the same bytes in the same run:",
            "",
            *render([("hosts", "hosts CPU ms/send", _ms), ("x_raw", "x raw", lambda v: "-" if v is None else f"{v:.2f}")], dist),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python scripts/bench_compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("trees", type=Path, nargs="*", help="source trees: A (the baseline, a checkout of asyncsync), then B, C, ... (each compared with A)")
    p.add_argument("--rounds", type=int, default=3, help="bench runs per tree, rotating the order (default 3)")
    p.add_argument("--harness", type=Path, metavar="TREE", help="measure every tree with TREE's bench code (its asyncsync/bench)")
    p.add_argument("--json", metavar="FILE", help="also write every round's rows as JSON")
    p.add_argument("--table", metavar="FILE", help="print the table of a --json file written before, and run nothing")
    opts = p.parse_args(argv)
    if opts.table:
        print(table(json.loads(Path(opts.table).read_text())))
        return
    if len(opts.trees) < 2:
        p.error("give at least two source trees (A, the baseline, then B)")
    if opts.rounds < 1:
        p.error("--rounds must be >= 1")
    for tree in [*opts.trees, *([opts.harness] if opts.harness else [])]:
        if not (tree / "asyncsync" / "bench").is_dir():
            p.error(f"{tree} is not a checkout of asyncsync (no asyncsync/bench in it)")
    if any(arg.split("=", 1)[0] in _OWN for arg in bench_args):
        p.error("--json and --plot are set by this script; give --json before the --")
    if not bench_args:
        bench_args = ["--transports", "shm", "--params", "10k", "--workers", "1", "--repeats", "300", *_QUIET]
    harness = opts.harness.resolve() if opts.harness else None
    result = compare([t.resolve() for t in opts.trees], bench_args, opts.rounds, harness)
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
