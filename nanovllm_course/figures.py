"""Draw the course figures (figures/chNN_*.png) with matplotlib's Agg back-end.

Each chapter's drawing code lives in `nanovllm_course/figures_chNN.py`, a module with a function
`draw(out_dir: Path) -> list[Path]` that writes that chapter's figures (named `chNN_<what>.png`) with
`save(fig, out_dir / name)` from here. `python -m nanovllm_course figures [NN ...]` runs them all
(or those named). Figures are drawn from fixed seeds and saved without a timestamp or software tag, so
redrawing on the same library versions gives the same bytes.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"figure.dpi": 100, "font.size": 10, "axes.spines.top": False, "axes.spines.right": False,
         "axes.grid": True, "grid.alpha": 0.3, "svg.hashsalt": "nanovllm"}


def figure(*args, **kwargs):
    """plt.subplots with the course style."""
    plt.rcParams.update(STYLE)
    return plt.subplots(*args, **kwargs)


def save(fig, path: Path) -> Path:
    """Save a figure deterministically (no Software/date metadata) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def chapter_modules() -> dict[str, str]:
    """{"01": "nanovllm_course.figures_ch01", ...} for every figures_chNN module."""
    import nanovllm_course as pkg
    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("figures_ch") and info.name[10:].isdigit():
            found[info.name[10:]] = f"{pkg.__name__}.{info.name}"
    return dict(sorted(found.items()))


def draw(chapters: list[str] | None, out_dir: Path) -> list[Path]:
    written = []
    for num, modname in chapter_modules().items():
        if chapters and num not in chapters and str(int(num)) not in chapters:
            continue
        written += importlib.import_module(modname).draw(Path(out_dir))
    return written
