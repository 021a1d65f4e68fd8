"""The benchmark's plot (``python -m asyncsync.bench --plot FILE.png``): its legend reads at
the size the docs show the figure, once for every panel, and covers no data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from asyncsync.bench._report import write_plot  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _row(transport: str, workers: int, params: str, n: int, ms: float, **extra: Any) -> dict[str, Any]:
    return {"kind": "latency", "transport": transport, "workers": workers, "params": params, "n_params": n,
            "median_ms": ms, "p90_ms": ms * 1.2, "floor_ms": n * 4e-9, **extra}  # fmt: skip


def test_the_plot_has_one_readable_legend_below_the_panels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved: list[tuple[Figure, bool]] = []
    real_savefig = Figure.savefig

    def savefig(fig: Figure, *args: Any, **kwargs: Any) -> None:
        real_savefig(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()  # as drawn into the file
        boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
        below = bool(fig.legends) and all(fig.legends[0].get_window_extent(renderer).y1 <= b.y0 for b in boxes)
        saved.append((fig, below))

    monkeypatch.setattr(Figure, "savefig", savefig)
    rows = [
        _row(t, w, p, n, ms * w, **({"flat": True} if t == "shm flat" else {}))
        for t, ms in (("shm", 0.2), ("queue", 0.6), ("torchrl-mp", 4.0), ("shm flat", 0.15))
        for w in (1, 2)
        for p, n in (("10k", 10_000), ("1M", 1_000_000))
    ]
    for r in rows:
        if r["transport"] == "shm flat":
            r["transport"] = "shm"
    path = tmp_path / "bench.png"
    write_plot(str(path), rows, {"cpu_model": "test", "cores": 2, "torch": "x"})
    assert path.stat().st_size > 0
    ((fig, legend_below),) = saved
    assert [ax.get_legend() for ax in fig.axes] == [None, None], "one legend for the figure, not one per panel"
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["shm", "queue", "torchrl-mp", "shm flat", "one-copy floor"]
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 10
    assert legend_below, "the legend is below the panels, covering no data"
