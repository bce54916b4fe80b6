"""`drelay serve-bench --plot`: tokens/s against concurrency, one line per endpoint (matplotlib, optional)."""

from __future__ import annotations

import os
from pathlib import Path

from drelay_model.errors import DRelayError


def check_plot_path(path: str | None) -> None:
    """Before anything runs: matplotlib importable, a .png path in a folder that exists."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DRelayError("--plot: needs matplotlib (pip install matplotlib)") from None
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise DRelayError(f"--plot: give a .png path, got '{path}'")
    if not p.parent.is_dir():
        raise DRelayError(f"--plot: folder '{p.parent}' does not exist")
    if p.is_dir():
        raise DRelayError(f"--plot: '{path}' is a folder")


def write_plot(path: str, levels: list[tuple[list[dict], dict | None]], endpoints) -> None:
    """levels: per concurrency level, one summary row per endpoint (and the ratios, unused here).
    Written to a temporary file and renamed, so the path never holds half a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    levels_c = [rows[0]["concurrency"] for rows, _ in levels]
    for i, e in enumerate(endpoints):
        ax.plot(levels_c, [rows[i]["tokens_per_s"] for rows, _ in levels], marker="o", label=f"{e.tag}: {e.label} ({e.method})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels_c, [str(c) for c in levels_c])
    ax.set_xlabel("concurrency (client streams)")
    ax.set_ylabel("completion tokens / s")
    ax.set_title("drelay serve-bench")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = Path(path).with_suffix(".partial.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
