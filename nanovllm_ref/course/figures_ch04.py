"""Figures of chapter 04 (KV cache and paged attention): generation FLOPs with and without a KV cache, and
three sequences' logical blocks mapped onto a shared pool of physical blocks."""
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, Rectangle

from nanovllm_ref.course.figures import figure, save

SEQ_COLORS = ["#6baed6", "#fd8d3c", "#74c476"]

# The example of the figure and of the notebook: block_size 4, a pool of 12 blocks.
EXAMPLE = dict(block_size=4, num_blocks=12, lengths=[10, 6, 13], block_tables=[[7, 2, 9], [4, 0], [1, 10, 5, 11]])


def kv_cache_flops(path: Path) -> Path:
    from nanovllm_ref.course.ch04 import generation_flops
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


def paged_blocks(path: Path) -> Path:
    bs, nb = EXAMPLE["block_size"], EXAMPLE["num_blocks"]
    lengths, tables = EXAMPLE["lengths"], EXAMPLE["block_tables"]
    fig, ax = figure(figsize=(10, 5.2))
    ax.axis("off")
    ax.grid(False)
    ax.set_xlim(-1.8, 14.5)
    ax.set_ylim(0.55, 7.2)
    w = 0.42                       # width of one slot
    owner = {}
    # left: logical blocks of each sequence
    for s, (n, table) in enumerate(zip(lengths, tables)):
        y = 5.8 - 2.1 * s
        ax.text(-1.7, y + 0.2, f"seq {'ABC'[s]}\n{n} tokens", fontsize=9, va="center")
        ax.text(0, y + 0.75, f"block table {table}", fontsize=8.5, color="#333")
        for i, block in enumerate(table):
            x = i * (bs * w + 0.25)
            for j in range(bs):
                pos = i * bs + j
                filled = pos < n
                ax.add_patch(Rectangle((x + j * w, y), w, 0.45, fc=SEQ_COLORS[s] if filled else "white",
                                       ec="#333", lw=0.8))
                if filled:
                    ax.text(x + j * w + w / 2, y + 0.22, str(pos), ha="center", va="center", fontsize=7)
            ax.text(x + bs * w / 2, y - 0.25, f"logical {i}", ha="center", fontsize=7.5)
            owner[block] = (s, i, x + bs * w / 2, y)
    ax.text(0, 6.95, "logical blocks (positions 0, 1, ...)", fontsize=10)
    # right: the physical pool, 3 rows of 4 blocks
    px, py = 9.2, 5.6
    ax.text(px, 6.95, f"physical KV cache: {nb} blocks of {bs} slots", fontsize=10)
    for b in range(nb):
        r, c = divmod(b, 4)
        x, y = px + c * (bs * 0.3 + 0.15), py - r * 1.6
        s = owner.get(b, (None,))[0]
        n_in = 0
        if s is not None:
            n_in = min(bs, lengths[s] - owner[b][1] * bs)
        for j in range(bs):
            ax.add_patch(Rectangle((x + j * 0.3, y), 0.3, 0.45, ec="#333", lw=0.8,
                                   fc=SEQ_COLORS[s] if s is not None and j < n_in else
                                   ("white" if s is not None else "#e0e0e0")))
        ax.text(x + bs * 0.15, y - 0.28, f"block {b}" + ("" if s is not None else " (free)"), ha="center",
                fontsize=7.5)
        if s is not None:
            _, i, lx, ly = owner[b]
            ax.add_patch(FancyArrowPatch((lx + bs * w / 2 + 0.05, ly + 0.22), (x - 0.05, y + 0.22),
                                         arrowstyle="->", mutation_scale=9, color=SEQ_COLORS[s], lw=1,
                                         connectionstyle="arc3,rad=0.08"))
    ax.text(-1.7, 0.65, "slot(p) = block_table[p // 4] * 4 + p % 4:  seq A's position 9 -> block 9, offset 1 -> "
                         "slot 37.  Only the last block of a sequence can be partly empty.", fontsize=9)
    ax.set_title("Paged KV cache: each sequence's blocks sit anywhere in one shared pool", fontsize=11)
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [kv_cache_flops(out_dir / "ch04_kv_cache_flops.png"),
            paged_blocks(out_dir / "ch04_paged_blocks.png")]
