"""``python -m asyncsync.bench``: send-until-acked latency of asyncsync vs torchrl.

Example::

    python -m asyncsync.bench --params 10k,1M/256,100M --workers 1,2 --repeats 15 \\
        --json bench.json --plot docs/bench.png --loop-lag
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 1, got {text!r}")
    return values


def _specs(text: str) -> list[str]:
    from asyncsync.bench._workload import parse_params

    items = _csv(text)
    for spec in items:
        try:
            parse_params(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def parser() -> argparse.ArgumentParser:
    from asyncsync.bench import DEFAULT_PARAMS, DEFAULT_REPEATS, DEFAULT_WORKERS

    p = argparse.ArgumentParser(
        prog="python -m asyncsync.bench",
        description="Latency of a weight send until every worker acked it: asyncsync's transports vs torchrl's schemes, "
        "against the one-copy floor. Progress goes to stderr, the markdown table to stdout.",
    )
    p.add_argument(
        "--transports",
        type=_csv,
        default=None,
        help="comma-separated: shm,queue,shm-uvloop,shm-poll,torchrl-mp,torchrl-shared,dist-gloo (default: all available but "
        "dist-gloo; shm-uvloop: shm with the trainer and its workers on uvloop; shm-poll: shm with workers that spin "
        "on poll_nowait(), also reporting the publish-to-commit time; "
        "dist-gloo: the multi-host scheme on loopback, --hosts relays with --workers workers each, against a raw "
        "gloo broadcast of the same bytes)",
    )
    p.add_argument("--hosts", type=int, default=2, help="dist-gloo: simulated hosts (relay processes), default 2")
    p.add_argument(
        "--params",
        type=_specs,
        default=list(DEFAULT_PARAMS),
        help=f"model sizes N or N/T (N params in T tensors), default {','.join(DEFAULT_PARAMS)}",
    )
    p.add_argument("--workers", type=_ints, default=list(DEFAULT_WORKERS), help="worker counts, default 1,2")
    p.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed sends per row after 2 warm-up sends (default {DEFAULT_REPEATS})",
    )
    p.add_argument("--json", metavar="FILE", help="write machine info and every row as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a log-log plot of latency vs model size")
    p.add_argument(
        "--loop-lag",
        action="store_true",
        help="measure the worker's event-loop lag while the largest model lands (commit swap vs copy)",
    )
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="RSS, /dev/shm and memfd over 20 sends of the largest model (default: on when it has >= 25M params)",
    )
    p.add_argument(
        "--echo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each row, time a bare round trip of a small message to its workers, for the 'x echo' column "
        "(default: on; --no-echo skips it)",
    )
    p.add_argument(
        "--floors",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each row, time a raw blocking socketpair round trip and a spin on a shared-memory version word "
        "to its workers, for the 'x socket' and 'x spin' columns (default: on)",
    )
    p.add_argument(
        "--flat",
        action="store_true",
        help="also measure every asyncsync row with the trainer's model flattened (asyncsync.flatten_parameters)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from asyncsync.bench import available_transports, run_benchmark
    from asyncsync.bench._report import machine_info, markdown, write_json, write_plot

    if args.repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2
    transports = args.transports
    dist = transports is not None and "dist-gloo" in transports
    if dist:
        transports = [t for t in transports if t != "dist-gloo"] or None
        if args.hosts < 1:
            print("--hosts must be >= 1", file=sys.stderr)
            return 2
    if transports is not None:
        known = ("shm", "queue", "shm-uvloop", "shm-poll", "torchrl-mp", "torchrl-shared")
        bad = [t for t in transports if t not in known]
        if bad:
            print(f"unknown transport(s) {bad}; expected some of {list(known)}", file=sys.stderr)
            return 2
        missing = [t for t in transports if t not in available_transports()]
        if missing:
            print(f"{missing} need torchrl or uvloop, which cannot be imported here", file=sys.stderr)
            return 2
    machine = machine_info()
    print(
        f"# {machine['cpu_model']}, {machine['cores']} cores, python {machine['python']}, torch {machine['torch']}, "
        f"tensordict {machine['tensordict']}, torchrl {machine['torchrl']}",
        file=sys.stderr,
        flush=True,
    )
    load = machine.get("loadavg")
    if load and machine.get("cores") and load[0] > 0.5 * machine["cores"]:
        print(
            f"# warning: load average {load[0]:.2f} on {machine['cores']} cores: other processes are busy, numbers will be noisy",
            file=sys.stderr,
        )
    if dist:
        from asyncsync.bench._dist import dist_markdown, run_dist_rows

        dist_rows = run_dist_rows(args.params, args.hosts, args.workers, args.repeats, progress=lambda m: print(m, file=sys.stderr, flush=True))
        sys.stdout.write(dist_markdown(dist_rows))
        sys.stdout.flush()
        if args.json:
            import json

            with open(args.json, "w") as fh:
                json.dump({"machine": machine, "rows": dist_rows}, fh, indent=1)
            print(f"wrote {args.json}", file=sys.stderr)
        if transports is None:
            return 0
    rows = run_benchmark(
        transports,
        args.params,
        args.workers,
        args.repeats,
        loop_lag=args.loop_lag,
        memory=args.memory,
        echo=args.echo,
        floors=args.floors,
        flat=args.flat,
        progress=True,
    )
    sys.stdout.write(markdown(rows))
    sys.stdout.flush()
    if args.json:
        write_json(args.json, rows, machine)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(args.plot, rows, machine)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # Spawned workers import this module as __mp_main__: the guard keeps them out.
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
