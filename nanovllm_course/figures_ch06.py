"""Figures of chapter 06 (Triton kernels): the tile walk of a tiny 2-D kernel, one decode program walking
its key tiles through a block table, and (when bench/results/ch06_kernels_h200.json exists) the H200
timing of an E6.3-style decode kernel against the engine's split-KV decode."""
import json
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, Rectangle

from nanovllm_course.figures import figure, save

REPO = Path(__file__).resolve().parents[1]
TIMING_JSON = REPO / "bench" / "results" / "ch06_kernels_h200.json"
COLORS = ["#6baed6", "#fd8d3c", "#74c476", "#9e9ac8", "#fdd0a2", "#c7e9c0"]

# The tiny kernel of the notebook: a 6 x 10 matrix in 4 x 4 tiles.
WALK = dict(M=6, N=10, BLOCK_M=4, BLOCK_N=4)


def tile_owner(M, N, BLOCK_M, BLOCK_N):
    """Program number pid_m * grid_n + pid_n of every element (what the notebook's `who` tensor holds)."""
    grid_n = -(-N // BLOCK_N)
    return [[(i // BLOCK_M) * grid_n + j // BLOCK_N for j in range(N)] for i in range(M)]


def tile_walk(path: Path) -> Path:
    M, N, BM, BN = (WALK[k] for k in ("M", "N", "BLOCK_M", "BLOCK_N"))
    grid_m, grid_n = -(-M // BM), -(-N // BN)
    fig, ax = figure(figsize=(8.2, 5.2))
    ax.axis("off")
    ax.grid(False)
    ax.set_xlim(-1.2, grid_n * BN + 0.6)
    ax.set_ylim(grid_m * BM + 0.9, -1.6)
    for pm in range(grid_m):
        for pn in range(grid_n):
            program = pm * grid_n + pn
            color = COLORS[program % len(COLORS)]
            for i in range(pm * BM, (pm + 1) * BM):
                for j in range(pn * BN, (pn + 1) * BN):
                    inside = i < M and j < N
                    ax.add_patch(Rectangle((j, i), 1, 1, fc=color if inside else "white", ec="#999", lw=0.5,
                                           hatch=None if inside else "///", alpha=1.0 if inside else 0.6))
            ax.add_patch(Rectangle((pn * BN, pm * BM), BN, BM, fill=False, ec="#222", lw=2))
            cx = (pn * BN + min((pn + 1) * BN, N)) / 2          # centre of the tile's part inside the matrix
            cy = (pm * BM + min((pm + 1) * BM, M)) / 2
            ax.text(cx, cy, f"program {program}\npid = ({pm}, {pn})", ha="center",
                    va="center", fontsize=9, fontweight="bold")
    ax.add_patch(Rectangle((0, 0), N, M, fill=False, ec="#c00", lw=2.2, ls="--"))
    ax.text(N + 0.1, M - 0.2, f"matrix edge\n({M} x {N})", color="#c00", fontsize=8.5, va="bottom")
    for j in range(grid_n * BN):
        ax.text(j + 0.5, -0.25, str(j), ha="center", fontsize=7, color="#555")
    for i in range(grid_m * BM):
        ax.text(-0.3, i + 0.6, str(i), ha="right", fontsize=7, color="#555")
    ax.text(0, -0.95, f"grid = (cdiv({M}, {BM}), cdiv({N}, {BN})) = ({grid_m}, {grid_n}); each program loads one "
                      f"{BM} x {BN} tile", fontsize=9.5)
    ax.text(0, grid_m * BM + 0.6, "hatched: lanes outside the matrix, switched off by the mask "
                                  "(rows < M) & (cols < N)", fontsize=9)
    ax.set_title("The tile walk of double_kernel", fontsize=11)
    return save(fig, path)


# The decode example: block size 4, BLOCK_N 8, a 13-token context with block table [5, 1, 6, 3, -1].
DECODE = dict(block_size=4, block_n=8, context=13, table=[5, 1, 6, 3, -1], num_blocks=8)


def decode_walk(path: Path) -> Path:
    bs, bn, n, table, nb = (DECODE[k] for k in ("block_size", "block_n", "context", "table", "num_blocks"))
    fig, ax = figure(figsize=(10, 4.8))
    ax.axis("off")
    ax.grid(False)
    w = 0.42
    num_tiles = -(-n // bn)
    ax.set_xlim(-0.4, max(num_tiles * bn, nb * (bs + 0.6)) * w + 0.6)
    ax.set_ylim(-0.6, 5.4)
    tile_colors = ["#6baed6", "#fd8d3c"]
    # top: the key positions of the sequence, grouped in tiles of BLOCK_N
    y_pos = 3.8
    ax.text(0, 5.05, f"program (seq b, kv_head): context_lens[b] = {n}, BLOCK_N = {bn}, block_size = {bs}, "
                     f"block_tables[b] = {table}", fontsize=9.5)
    for t in range(num_tiles * bn):
        valid = t < n
        ax.add_patch(Rectangle((t * w, y_pos), w, 0.45, ec="#333", lw=0.7,
                               fc=tile_colors[t // bn] if valid else "white", hatch=None if valid else "///"))
        ax.text(t * w + w / 2, y_pos + 0.22, str(t), ha="center", va="center", fontsize=7)
    for k in range(num_tiles):
        ax.text(k * bn * w + bn * w / 2, y_pos + 0.7, f"tile {k}: positions {k * bn}..{k * bn + bn - 1}",
                ha="center", fontsize=8.5)
    ax.text(num_tiles * bn * w + 0.1, y_pos + 0.12, "hatched: pos >= context_len\n(score -inf, no table load)",
            fontsize=8)
    # bottom: the physical blocks of the cache
    y_blk = 0.9
    for b in range(nb):
        x0 = b * (bs + 0.6) * w
        owner = table.index(b) if b in table else None
        for j in range(bs):
            pos = owner * bs + j if owner is not None else None
            used = pos is not None and pos < n
            ax.add_patch(Rectangle((x0 + j * w, y_blk), w, 0.45, ec="#333", lw=0.7,
                                   fc=tile_colors[pos // bn] if used else "#eeeeee"))
            if used:
                ax.text(x0 + j * w + w / 2, y_blk + 0.22, str(pos), ha="center", va="center", fontsize=7)
        ax.text(x0 + bs * w / 2, y_blk - 0.3, f"block {b}", ha="center", fontsize=8)
    ax.text(0, -0.45, "k_cache (physical blocks). Key t is row block_tables[b, t // 4] * 4 + t % 4; "
                      "one program reads each K/V row once for all G query heads of its KV head.", fontsize=9)
    for logical, b in enumerate(table):
        if b < 0 or logical * bs >= n:
            continue
        x_from = (logical * bs + bs / 2) * w
        x_to = b * (bs + 0.6) * w + bs * w / 2
        ax.add_patch(FancyArrowPatch((x_from, y_pos - 0.05), (x_to, y_blk + 0.5), arrowstyle="-|>",
                                     mutation_scale=10, color="#555", lw=1.0))
    ax.set_title("E6.3: one decode program walks its context tile by tile through the block table", fontsize=11)
    return save(fig, path)


def decode_timing(path: Path, data: dict) -> Path:
    rows = data["rows"]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = figure(1, len(contexts), figsize=(5.2 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        sel = sorted((r for r in rows if r["context"] == ctx), key=lambda r: r["batch"])
        batches = [r["batch"] for r in sel]
        for key, label, style in (("student_us", "E6.3 one-pass kernel (the solution)", "o-"),
                                  ("reference_us", "engine: split-KV + merge", "s-"),
                                  ("reference_1split_us", "engine kernel, 1 split", "^--")):
            if all(key in r for r in sel):
                ax.plot(batches, [r[key] for r in sel], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("microseconds per call")
        ax.set_title(f"context {ctx} tokens", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"Paged decode, one Qwen3-0.6B layer (16 q / 8 kv heads, d 128, bf16), {data.get('device', 'GPU')}",
                 fontsize=10.5)
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    out = [tile_walk(out_dir / "ch06_tile_walk.png"), decode_walk(out_dir / "ch06_decode_walk.png")]
    if TIMING_JSON.is_file():      # measured on a GPU by bench/ch06_kernel_timing.py; skipped until then
        out.append(decode_timing(out_dir / "ch06_decode_timing_h200.png", json.loads(TIMING_JSON.read_text())))
    return out
