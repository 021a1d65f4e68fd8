"""Compare two checkouts of asyncsync with the bench, in one run, alternating between them.

Each round runs ``python -m asyncsync.bench`` once from each source tree (the order flips
every round, so a machine that gets busier or quieter during the run favours neither),
then the rows of both trees are printed side by side: the median over the rounds of each
row's median latency and of the trainer's CPU per send, and the ratio B / A. On a shared
or noisy machine, read the ratios, and use several rounds.

Example (the previous release against your working copy)::

    git worktree add --detach ../asyncsync-prev v0.3.0
    python scripts/bench_compare.py ../asyncsync-prev . --rounds 4 -- \\
        --transports shm --params 10k,1M/256 --workers 1,2 --repeats 300

Everything after ``--`` goes to the bench of both trees; a flag that one tree's bench
does not know (an older release) is left out for that tree, and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def _key(row: dict[str, Any]) -> tuple[str, str, str, bool]:
    if "workers_per_host" in row:  # a dist-gloo row
        workers = f"{row['hosts']} x {row['workers_per_host']}"
    else:
        workers = str(row["workers"])
    return (row["transport"], row["params"], workers, bool(row.get("flat", False)))


def _latency(row: dict[str, Any]) -> float | None:
    return row.get("median_ms", row.get("send_median_ms"))


def _cost(row: dict[str, Any]) -> float | None:
    """The trainer's CPU per send; for a dist-gloo row (which has none), its ratio to the raw broadcast."""
    return row.get("trainer_cpu_ms_per_send", row.get("x_raw"))


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(b: float | None, a: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None else "-"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def compare(a: Path, b: Path, bench_args: list[str], rounds: int) -> dict[str, Any]:
    """Run both trees' bench *rounds* times, alternating; return every row of every round."""
    args = {t: _args_for(t, bench_args, _known_flags(t)) for t in (a, b)}
    runs: dict[Path, list[list[dict[str, Any]]]] = {a: [], b: []}
    for r in range(rounds):
        for tree in (a, b) if r % 2 == 0 else (b, a):
            runs[tree].append(_run(tree, args[tree]))
    return {"a": str(a), "b": str(b), "bench_args": bench_args, "rounds": {str(t): rs for t, rs in runs.items()}}


def table(result: dict[str, Any]) -> str:
    """The markdown table: per row, medians over the rounds for A and B, and B / A."""
    a, b = result["a"], result["b"]
    per: dict[str, dict[tuple[str, str, str, bool], dict[str, list[float | None]]]] = {a: {}, b: {}}
    order: list[tuple[str, str, str, bool]] = []
    for tree in (a, b):
        for rows in result["rounds"][tree]:
            for row in rows:
                k = _key(row)
                if k not in order:
                    order.append(k)
                cell = per[tree].setdefault(k, {"median_ms": [], "trainer": []})
                cell["median_ms"].append(_latency(row))
                cell["trainer"].append(_cost(row))
    lines = [
        f"A: {a}  B: {b}  ({len(result['rounds'][a])} rounds each, alternating; medians over the rounds)",
        "(dist-gloo rows: workers is hosts x workers per host, and the CPU columns hold x raw, the send over a raw gloo broadcast)",
        "",
        "| transport | params | workers | A median ms | B median ms | B / A | A trainer CPU ms/send | B trainer CPU ms/send | B / A |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in order:
        ca, cb = per[a].get(k), per[b].get(k)
        if ca is None or cb is None:
            continue
        ma, mb = _median(ca["median_ms"]), _median(cb["median_ms"])
        ta, tb = _median(ca["trainer"]), _median(cb["trainer"])
        name = k[0] + (" (flat)" if k[3] else "")
        lines.append(f"| {name} | {k[1]} | {k[2]} | {_ms(ma)} | {_ms(mb)} | {_ratio(mb, ma)} | {_ms(ta)} | {_ms(tb)} | {_ratio(tb, ta)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python scripts/bench_compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, nargs="?", help="source tree A (the baseline: a checkout of asyncsync)")
    p.add_argument("b", type=Path, nargs="?", help="source tree B (compared with A)")
    p.add_argument("--rounds", type=int, default=3, help="bench runs per tree, alternating (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write every round's rows as JSON")
    p.add_argument("--table", metavar="FILE", help="print the table of a --json file written before, and run nothing")
    opts = p.parse_args(argv)
    if opts.table:
        print(table(json.loads(Path(opts.table).read_text())))
        return
    if opts.a is None or opts.b is None:
        p.error("give the two source trees A and B")
    if opts.rounds < 1:
        p.error("--rounds must be >= 1")
    for tree in (opts.a, opts.b):
        if not (tree / "asyncsync" / "bench").is_dir():
            p.error(f"{tree} is not a checkout of asyncsync (no asyncsync/bench in it)")
    if any(arg.split("=", 1)[0] in _OWN for arg in bench_args):
        p.error("--json and --plot are set by this script; give --json before the --")
    if not bench_args:
        bench_args = ["--transports", "shm", "--params", "10k", "--workers", "1", "--repeats", "300", *_QUIET]
    result = compare(opts.a.resolve(), opts.b.resolve(), bench_args, opts.rounds)
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
