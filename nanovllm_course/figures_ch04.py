"""Figures of chapter 04 (KV cache and paged attention): generation FLOPs with and without a KV cache, and
three sequences' logical blocks mapped onto a shared pool of physical blocks."""
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, Rectangle

from nanovllm_course.figures import figure, save

SEQ_COLORS = ["#6baed6", "#fd8d3c", "#74c476"]

# The example of the figure and of the notebook: block_size 4, a pool of 12 blocks.
EXAMPLE = dict(block_size=4, num_blocks=12, lengths=[10, 6, 13], block_tables=[[7, 2, 9], [4, 0], [1, 10, 5, 11]])


def kv_cache_flops(path: Path) -> Path:
    from nanovllm_course.ch04 import generation_flops
    prompt, n = 512, 1024
    steps = list(range(1, n + 1))
    without = generation_flops(prompt, n, cached=False)
    with_cache = generation_flops(prompt, n, cached=True)
    fig, ax = figure(figsize=(6.8, 4))
    ax.semilogy(steps, without, label="no cache: every step recomputes the whole sequence")
    ax.semilogy(steps, with_cache, label="KV cache: prompt once, then one token per step")
    for k in (256, 1000):
        ax.annotate(f"{without[k - 1] / with_cache[k - 1]:.0f}x more", xy=(k, without[k - 1]),
                    xytext=(k - 40, without[k - 1] / 12), fontsize=9, ha="center",
                    arrowprops=dict(arrowstyle="->"))
    ax.set_xlabel(f"tokens generated after a {prompt}-token prompt")
    ax.set_ylabel("cumulative FLOPs")
    ax.set_title("Qwen3-0.6B: the cost of generating without and with a KV cache", fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    return save(fig, path)


SLOT_W, BLOCK_H = 0.3, 0.45       # width of one slot, height of a block (logical and physical alike)
BLOCK_GAP, SEQ_GAP = 0.2, 0.8      # between two blocks, between two sequences
LOGICAL_Y, PHYSICAL_Y = 4.0, 1.0   # bottom edges of the two rows


def paged_layout(example: dict = EXAMPLE) -> dict:
    """Where paged_blocks draws everything, in data coordinates, so tests can check the arrows.

    The sequences' logical blocks sit side by side in a top row, the pool of physical blocks in a bottom
    row, and every arrow runs down through the empty band between them, from the bottom edge of logical
    block i to the centre of the top edge of the physical block that the block table names.
    Returns {"logical": {(seq, i): (x, y, w, h)}, "physical": {block: (x, y, w, h)},
    "arrows": [(seq, i, block, (x0, y0), (x1, y1))]}."""
    bs, nb, tables = example["block_size"], example["num_blocks"], example["block_tables"]
    bw = bs * SLOT_W
    physical = {b: (b * (bw + BLOCK_GAP), PHYSICAL_Y, bw, BLOCK_H) for b in range(nb)}
    pool_w = nb * bw + (nb - 1) * BLOCK_GAP
    top_w = sum(len(t) * bw + (len(t) - 1) * BLOCK_GAP for t in tables) + (len(tables) - 1) * SEQ_GAP
    logical, x = {}, (pool_w - top_w) / 2
    for s, table in enumerate(tables):
        for i in range(len(table)):
            logical[(s, i)] = (x, LOGICAL_Y, bw, BLOCK_H)
            x += bw + BLOCK_GAP
        x += SEQ_GAP - BLOCK_GAP
    arrows = []
    for s, table in enumerate(tables):
        for i, b in enumerate(table):
            lx, ly, lw, _ = logical[(s, i)]
            px, py, pw, ph = physical[b]
            arrows.append((s, i, b, (lx + lw / 2, ly - 0.4), (px + pw / 2, py + ph)))
    return {"logical": logical, "physical": physical, "arrows": arrows}


def _draw_block(ax, x, y, color, n_filled, first_pos=None):
    """One block of SLOT_W-wide slots: the first n_filled coloured (numbered from first_pos if given)."""
    for j in range(EXAMPLE["block_size"]):
        filled = j < n_filled
        ax.add_patch(Rectangle((x + j * SLOT_W, y), SLOT_W, BLOCK_H, ec="#333", lw=0.8, zorder=2,
                               fc=color if filled else ("white" if color != "#e0e0e0" else color)))
        if filled and first_pos is not None:
            ax.text(x + (j + 0.5) * SLOT_W, y + BLOCK_H / 2, str(first_pos + j), ha="center", va="center",
                    fontsize=6.5, zorder=3)


def paged_blocks(path: Path) -> Path:
    bs, nb = EXAMPLE["block_size"], EXAMPLE["num_blocks"]
    lengths, tables = EXAMPLE["lengths"], EXAMPLE["block_tables"]
    layout = paged_layout()
    pool_w = layout["physical"][nb - 1][0] + layout["physical"][nb - 1][2]
    fig, ax = figure(figsize=(11, 4.6))
    ax.axis("off")
    ax.grid(False)
    ax.set_xlim(-0.2, pool_w + 0.2)
    ax.set_ylim(-0.35, 5.75)
    owner = {b: (s, i) for s, table in enumerate(tables) for i, b in enumerate(table)}
    # top: the logical blocks of each sequence
    ax.text(-0.1, 5.5, "logical blocks of each sequence (positions 0, 1, ...)", fontsize=10)
    for s, (n, table) in enumerate(zip(lengths, tables)):
        x0 = layout["logical"][(s, 0)][0]
        ax.text(x0, LOGICAL_Y + 0.85, f"seq {'ABC'[s]}: {n} tokens", fontsize=9, fontweight="bold")
        ax.text(x0, LOGICAL_Y + 0.6, f"block table {table}", fontsize=8.5, color="#333")
        for i in range(len(table)):
            x, y, w, _ = layout["logical"][(s, i)]
            _draw_block(ax, x, y, SEQ_COLORS[s], min(bs, n - i * bs), first_pos=i * bs)
            ax.text(x + w / 2, y - 0.25, f"logical {i}", ha="center", fontsize=7.5)
    # bottom: the physical pool
    for b in range(nb):
        x, y, w, _ = layout["physical"][b]
        s, i = owner.get(b, (None, None))
        if s is None:
            _draw_block(ax, x, y, "#e0e0e0", bs)
        else:
            _draw_block(ax, x, y, SEQ_COLORS[s], min(bs, lengths[s] - i * bs))
        ax.text(x + w / 2, y - 0.28, f"block {b}", ha="center", fontsize=7.5,
                fontweight="bold" if s is not None else "normal")
        if s is None:
            ax.text(x + w / 2, y - 0.5, "(free)", ha="center", fontsize=7, color="#666")
    ax.text(-0.1, 0.05, f"physical KV cache: one shared pool of {nb} blocks of {bs} slots", fontsize=10)
    # arrows: logical block i -> the top of the physical block block_table[i]
    for s, i, b, start, end in layout["arrows"]:
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, color=SEQ_COLORS[s],
                                     lw=1.3, shrinkA=0, shrinkB=0, zorder=1))
    ax.text(-0.1, -0.3, "slot(p) = block_table[p // 4] * 4 + p % 4:  seq A's position 9 -> block 9, offset 1 -> "
                        "slot 37.  Only the last block of a sequence can be partly empty.", fontsize=9)
    ax.set_title("Paged KV cache: each sequence's blocks sit anywhere in one shared pool", fontsize=11)
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [kv_cache_flops(out_dir / "ch04_kv_cache_flops.png"),
            paged_blocks(out_dir / "ch04_paged_blocks.png")]
