"""Figures of the benchmarks and tools: matplotlib (an optional extra, `pip install dspine[plot]`)
on its file-only Agg backend, and one way to write a figure."""

from __future__ import annotations

from pathlib import Path


def pyplot(redraw_hint: str | None = None):
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is not installed
    (after printing that no plot is drawn, and `redraw_hint`: how to draw it later)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot" + (f"; {redraw_hint}" if redraw_hint else ""), flush=True)
        return None
    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Lay out, write and close `fig`; returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
