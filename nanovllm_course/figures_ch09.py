"""Figures of chapter 09 (tensor parallelism): the shard layout of each parallel layer at tp = 2, and the
committed H200 measurement of TP=1 vs TP=2 (read from bench/results/, so it redraws without a GPU)."""
import json
from pathlib import Path

from matplotlib.patches import Rectangle

from nanovllm_course.figures import figure, save

ROOT = Path(__file__).resolve().parents[1]
RANK_COLORS = ["#6baed6", "#fd8d3c"]          # rank 0, rank 1
TP1 = ROOT / "bench/results/bench_h200x2_tp1_round2_2026-11-30_call5.json"
TP2 = ROOT / "bench/results/bench_h200x2_tp2_round2_2026-11-30_call5.json"

# Qwen3-0.6B: hidden 1024, 16 q heads and 8 kv heads of 128, intermediate 3072, vocab 151,936. Drawn not to
# scale (the vocabulary would be 150 times taller than the hidden size); the labels give the sizes.


FONT = 9            # every label: the figure is drawn at the width a notebook shows it (<= 1000 px), so 9 pt
                    # stays about 12 px high on screen
WIDTH_IN = 9.0      # inches at figures.save's 110 dpi: 990 px


def _block(ax, x, y, w, h, rank, label=None, hatch=None):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=RANK_COLORS[rank] if rank is not None else "#eeeeee",
                           edgecolor="black", lw=0.8, hatch=hatch))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=FONT)


def _panel(ax, title, note):
    ax.set_xlim(-0.2, 4.6)
    ax.set_ylim(-1.2, 6.6)
    ax.axis("off")
    ax.set_title(title, fontsize=FONT + 1)
    ax.text(2.2, -0.75, note, ha="center", va="center", fontsize=FONT)


def layout(path: Path) -> Path:
    """Top: each checkpoint tensor ([out, in] as stored), colored by the rank that holds each part at tp = 2.
    Beside it: what each rank's parameter looks like after loading. Two rows of panels, so the figure fits a
    notebook's width at full size (FONT, WIDTH_IN)."""
    fig, grid = figure(2, 3, figsize=(WIDTH_IN, 8.6))
    axes = [grid[0, 0], grid[0, 1], grid[1, 0], grid[1, 1], grid[1, 2]]
    grid[0, 2].axis("off")
    # QKV: rows of q, k, v each split in two; rank r's fused parameter = [q_r; k_r; v_r].
    ax = axes[0]
    _panel(ax, "QKV (column-parallel, fused)", "split the OUTPUT rows of q, k, v\nby heads; no communication")
    y = 6.0
    for name, h, heads in (("q", 2.0, 8), ("k", 1.0, 4), ("v", 1.0, 4)):
        for r in range(2):
            y -= h / 2
            _block(ax, 0, y, 2.1, h / 2, r, f"{name} heads {r * heads}-{(r + 1) * heads - 1}")
        y -= 0.1
    ax.text(1.05, y - 0.2, "checkpoint q | k | v\n[2048 | 1024 | 1024]\nx 1024", ha="center", va="top", fontsize=FONT)
    for r in range(2):
        x, y = 2.5 + r * 1.05, 6.0
        for name, h in (("q", 1.0), ("k", 0.5), ("v", 0.5)):
            y -= h
            _block(ax, x, y, 0.9, h, r, f"{name}{r}")
        ax.text(x + 0.45, 6.2, f"rank {r}", ha="center", fontsize=FONT)
    ax.text(3.55, 3.8, "per rank:\n8 q + 4 kv\nheads", ha="center", va="top", fontsize=FONT)
    # gate/up: same, two tensors.
    ax = axes[1]
    _panel(ax, "gate | up (column-parallel)", "slice gate and up SEPARATELY;\nSiLU(gate) * up stays on the rank")
    y = 6.0
    for name in ("gate", "up"):
        for r in range(2):
            y -= 0.8
            _block(ax, 0, y, 2.1, 0.8, r, f"{name} rows\n{r * 1536}-{(r + 1) * 1536 - 1}")
        y -= 0.1
    ax.text(1.05, y - 0.2, "checkpoint gate | up\n[3072 | 3072] x 1024", ha="center", va="top", fontsize=FONT)
    for r in range(2):
        x, y = 2.5 + r * 1.05, 6.0
        for name in ("gate", "up"):
            y -= 0.8
            _block(ax, x, y, 0.9, 0.8, r, f"{name}{r}")
        ax.text(x + 0.45, 6.2, f"rank {r}", ha="center", fontsize=FONT)
    ax.text(3.55, 4.2, "per rank:\n[3072 x 1024]", ha="center", va="top", fontsize=FONT)
    # o_proj and down_proj: split the INPUT columns.
    for ax, title, cols, inner in ((axes[2], "o_proj (row-parallel)", "2048\n(16 heads x 128)", "heads"),
                                   (axes[3], "down_proj (row-parallel)", "3072", "intermediate")):
        _panel(ax, title, "split the INPUT columns; the\nranks' partial sums are\nall-reduced (bias: rank 0)")
        for r in range(2):
            _block(ax, 0.2 + r * 2.0, 2.4, 2.0, 2.0, r, f"{inner}\ncolumns\nrank {r}")
        ax.text(2.2, 4.65, f"checkpoint 1024 x {cols}", ha="center", va="bottom", fontsize=FONT)
        ax.annotate("", xy=(4.2, 1.7), xytext=(0.2, 1.7), arrowprops=dict(arrowstyle="<->", lw=0.8))
        ax.text(2.2, 1.2, "y = x0 @ W0.T + x1 @ W1.T\n(all-reduce)", ha="center", va="top", fontsize=FONT)
    # embedding / LM head: split the vocabulary rows.
    ax = axes[4]
    _panel(ax, "embedding / LM head\n(vocab-parallel)", "embedding: masked lookup +\nall-reduce; LM head: logit\n"
           "slices gathered on rank 0")
    for r in range(2):
        _block(ax, 1.0, 5.6 - (r + 1) * 2.5, 2.4, 2.5, r,
               f"vocab rows\n{r * 75968:,} - {(r + 1) * 75968 - 1:,}\nrank {r}")
    ax.text(2.2, 5.75, "checkpoint 151,936 x 1024\n(not to scale)", ha="center", va="bottom", fontsize=FONT)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for c in RANK_COLORS]
    grid[0, 2].legend(handles, ["rank 0", "rank 1"], loc="center", frameon=False, fontsize=FONT + 1)
    fig.suptitle("Where each weight lives with tensor_parallel_size = 2 (Qwen3-0.6B sizes)", fontsize=FONT + 2)
    fig.tight_layout()
    return save(fig, path)


def throughput(path: Path) -> Path:
    """Output tok/s of the same 256-request workload on one H200 (TP=1) and on two H200s over NCCL (TP=2), both
    on the two-GPU host in one call: the median of three fresh engines each, with min-max bars, from the
    committed bench records."""
    runs = [json.loads(p.read_text())["runs"][0] for p in (TP1, TP2)]
    med = [r["tok_s"] for r in runs]
    lo = [r["tok_s"] - min(r["run_tok_s"]) for r in runs]
    hi = [max(r["run_tok_s"]) - r["tok_s"] for r in runs]
    fig, ax = figure(figsize=(6.2, 3.6))
    bars = ax.bar(["TP=1\n1 x H200", "TP=2\n2 x H200 (NCCL)"], med, color=["#6baed6", "#fd8d3c"], width=0.55,
                  yerr=[lo, hi], capsize=6)
    for b, v, h in zip(bars, med, hi):
        ax.text(b.get_x() + b.get_width() / 2, v + h, f"{v:,.0f} tok/s", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("output tokens / s (median of 3, min-max)")
    ax.set_ylim(0, max(med) * 1.25)
    ax.set_title(f"Qwen3-0.6B shape, 256 requests, Triton + CUDA graphs: TP=2 is {med[1] / med[0]:.2f}x TP=1",
                 fontsize=9)
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [layout(out_dir / "ch09_shard_layout.png"), throughput(out_dir / "ch09_tp_throughput.png")]
