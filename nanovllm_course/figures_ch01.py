"""Figures of chapter 01 (RMSNorm): the residual stream with fused add + norm, and bf16 vs fp32
accumulation error of mean(x^2) against hidden size."""
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from nanovllm_course.figures import figure, save


def residual_stream(path: Path) -> Path:
    fig, ax = figure(figsize=(9, 3.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 3.4)
    ax.axis("off")
    ax.grid(False)
    y = 2.6
    ax.annotate("", xy=(9.8, y), xytext=(0.2, y), arrowprops=dict(arrowstyle="->", lw=2.5, color="#444"))
    ax.text(0.2, y + 0.25, "residual stream (hidden states, one row per token)", fontsize=9, color="#444")
    boxes = [(1.2, "fused\nadd + RMSNorm", "#f6c26b"), (3.3, "attention", "#9ecae1"),
             (5.4, "fused\nadd + RMSNorm", "#f6c26b"), (7.5, "MLP", "#a1d99b")]
    for x, label, color in boxes:
        ax.add_patch(FancyBboxPatch((x, 0.6), 1.5, 1.0, boxstyle="round,pad=0.05", fc=color, ec="#333"))
        ax.text(x + 0.75, 1.1, label, ha="center", va="center", fontsize=9)
    for (x0, _, _), (x1, _, _) in zip(boxes, boxes[1:]):
        ax.add_patch(FancyArrowPatch((x0 + 1.55, 1.1), (x1 - 0.05, 1.1), arrowstyle="->", mutation_scale=12))
    for x, _, _ in (boxes[0], boxes[2]):      # norm reads x + residual from the stream and writes it back
        ax.add_patch(FancyArrowPatch((x + 0.5, y - 0.05), (x + 0.5, 1.65), arrowstyle="->", mutation_scale=12))
        ax.add_patch(FancyArrowPatch((x + 1.0, 1.65), (x + 1.0, y - 0.05), arrowstyle="->",
                                     mutation_scale=12, color="#c0392b"))
        ax.text(x + 1.05, 2.1, "x + residual", fontsize=8, color="#c0392b")
    for x, _, _ in (boxes[1], boxes[3]):
        ax.text(x + 0.75, 0.3, "output x goes to the next norm", ha="center", fontsize=7.5, color="#555")
    ax.set_title("One decoder layer: each norm first adds the previous block's output to the residual stream",
                 fontsize=10)
    return save(fig, path)


def accumulation_error(path: Path) -> Path:
    from nanovllm_course.ch01 import accumulation_error as measure
    sizes = [16, 32, 64, 128, 256, 576, 1024, 2048, 4096, 8192]
    err = measure(sizes)
    fig, ax = figure(figsize=(6.5, 4))
    ax.loglog(sizes, err["bf16"], "o-", label="running sum kept in bf16")
    ax.loglog(sizes, err["fp32"], "s-", label="running sum kept in fp32 (the reference)")
    ax.axhline(2 ** -9, color="gray", ls="--", lw=1)
    ax.text(sizes[3], 2 ** -9 / 2.5, "half a bf16 step (2^-9): the best a bf16 result can be", fontsize=8,
            color="gray")
    ax.set_xlabel("hidden size (number of squares summed)")
    ax.set_ylabel("median relative error of sqrt(mean(x^2))")
    ax.set_title("Summing x^2 in bf16 loses the small terms as the total grows")
    ax.legend(fontsize=8, loc="center right")
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [residual_stream(out_dir / "ch01_residual_stream.png"),
            accumulation_error(out_dir / "ch01_accumulation_error.png")]
