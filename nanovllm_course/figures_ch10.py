"""Figures of chapter 10 (CUDA graphs): the measured H200 decode step, eager vs graph replay, and the padding
that the capture buckets cost.

The numbers are copied from bench/results/bench_h200.json ("graph_sweep": Qwen3-0.6B shape, random weights,
bf16, Triton attention, context 512, measured 2026-11-29 on one H200) and /work/shared facts (437-494 kernels
per decode step, measured 2026-11-30), so the figure redraws without a GPU.
"""
from pathlib import Path

from nanovllm_course.figures import figure, save
from nanovllm_ref.engine.cuda_graph import graph_batch_sizes

# batch size -> (eager ms/step, graph replay ms/step), H200, context 512
SWEEP = {1: (50.93, 2.067), 2: (52.37, 2.161), 4: (52.85, 2.080), 8: (52.44, 2.122), 16: (51.89, 2.295),
         32: (51.76, 2.582), 64: (49.51, 3.058), 128: (49.34, 4.246), 256: (50.04, 6.752)}
KERNELS_PER_STEP = (437, 494)         # measured range over the bench workload's decode steps
WEIGHT_READ_MS = 0.28                 # 1.19 GB of weights at the measured 4.25 TB/s copy bandwidth
NUM_LAYERS = 28


def draw_launch_bound(out_dir: Path) -> Path:
    fig, (ax, bx) = figure(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.4, 1]})
    sizes = list(SWEEP)
    eager = [SWEEP[b][0] for b in sizes]
    graph = [SWEEP[b][1] for b in sizes]
    ax.plot(sizes, eager, "o-", color="#de2d26", label="eager: one Python launch per kernel")
    ax.plot(sizes, graph, "o-", color="#3182bd", label="CUDA graph replay: one launch per step")
    ax.axhline(WEIGHT_READ_MS, color="#636363", ls=":", lw=1)
    ax.text(1, WEIGHT_READ_MS * 1.15, "reading the weights once (0.28 ms)", fontsize=8, color="#636363")
    for b in (1, 64, 256):
        ax.annotate(f"{SWEEP[b][0] / SWEEP[b][1]:.0f}x", (b, SWEEP[b][1]), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=8, color="#3182bd")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("decode batch size (sequences)")
    ax.set_ylabel("ms per decode step (log)")
    ax.set_title("Qwen3-0.6B shape on one H200, bf16, context 512", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")

    lo, hi = KERNELS_PER_STEP
    mid = (lo + hi) / 2
    bars = [("eager", SWEEP[1][0], "#de2d26"), ("graph", SWEEP[1][1], "#3182bd"),
            ("weights\nfloor", WEIGHT_READ_MS, "#636363")]
    bx.bar([n for n, _, _ in bars], [v for _, v, _ in bars], color=[c for _, _, c in bars])
    for i, (_, v, _) in enumerate(bars):
        bx.text(i, v * 1.1, f"{v:.2f} ms", ha="center", fontsize=8)
    bx.set_yscale("log")
    bx.set_ylim(0.1, 150)
    bx.set_ylabel("ms per step at batch 1 (log)")
    bx.set_title(f"{lo}-{hi} kernels per step (about 16 per layer x {NUM_LAYERS})\n"
                 f"eager: ~{SWEEP[1][0] * 1000 / mid:.0f} us of host time per kernel", fontsize=10)
    return save(fig, out_dir / "ch10_launch_bound.png")


def _powers_of_two(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def draw_bucket_padding(out_dir: Path, max_num_seqs: int = 160) -> Path:
    fig, ax = figure(figsize=(10, 3.6))
    batches = list(range(1, max_num_seqs + 1))
    for sizes, color, label in ((graph_batch_sizes(max_num_seqs), "#3182bd",
                                 "engine buckets: 1, 2, 4, 8, then every 16, then max_num_seqs"),
                                (_powers_of_two(max_num_seqs), "#fdae6b", "powers of two only")):
        idle = [min(s for s in sizes if s >= b) - b for b in batches]
        ax.step(batches, idle, where="mid", color=color, label=f"{label} ({len(sizes)} graphs)")
    ax.axhline(15, color="#636363", ls=":", lw=1)
    ax.text(2, 17, "15 idle rows", fontsize=8, color="#636363")
    ax.set_xlabel(f"live batch size (max_num_seqs = {max_num_seqs})")
    ax.set_ylabel("idle (padding) rows replayed")
    ax.set_title("Each batch replays the smallest captured graph that fits; the rest of its rows are padding",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return save(fig, out_dir / "ch10_bucket_padding.png")


def draw(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [draw_launch_bound(out_dir), draw_bucket_padding(out_dir)]
