"""Figures of chapter 05 (block manager and prefix caching): two prompts sharing the blocks of a common
prefix, with hashes and ref counts, and the prefill work prefix caching saves (a model-free simulation)."""
import random
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, Rectangle

from nanovllm_course.figures import figure, save

A_COLOR, B_COLOR, SHARED = "#6baed6", "#fd8d3c", "#bcbddc"


def _slots(ax, x, y, n_filled, bs, color, w=0.32, labels=None):
    for j in range(bs):
        filled = j < n_filled
        ax.add_patch(Rectangle((x + j * w, y), w, 0.42, fc=color if filled else "white", ec="#333", lw=0.8))
        if filled and labels:
            ax.text(x + j * w + w / 2, y + 0.21, labels[j], ha="center", va="center", fontsize=6.5)


def prefix_sharing(path: Path) -> Path:
    """Prompt A = 8-token system prompt + 5 tokens, prompt B = same system prompt + 3 tokens, block size 4.
    A ran first: blocks 0, 1, 2 are full, written and hashed. B hits blocks 0 and 1."""
    from nanovllm_ref.engine.block_manager import BlockManager
    from nanovllm_ref.engine.sequence import Sequence
    bs = 4
    system = [11, 12, 13, 14, 15, 16, 17, 18]
    a = Sequence(system + [21, 22, 23, 24, 25], bs)
    b = Sequence(system + [31, 32, 33], bs)
    bm = BlockManager(6, bs)
    bm.allocate(a)
    a.num_cached_tokens = len(a)
    bm.hash_blocks(a)
    bm.allocate(b)

    fig, ax = figure(figsize=(10, 5))
    ax.axis("off")
    ax.grid(False)
    ax.set_xlim(-1.5, 13.2)
    ax.set_ylim(-0.2, 6.4)
    step = bs * 0.32 + 0.35
    rows = [(a, "A", A_COLOR, 5.3), (b, "B", B_COLOR, 0.6)]
    for seq, name, color, y in rows:
        ax.text(-1.45, y + 0.2, f"prompt {name}\n{len(seq)} tokens", fontsize=9, va="center")
        ax.text(0, y + 0.65 if name == "A" else y - 0.45,
                f"block table {seq.block_table}, num_cached_tokens {seq.num_cached_tokens}", fontsize=8.5)
        for i, block_id in enumerate(seq.block_table):
            n = min(bs, len(seq) - i * bs)
            shared = bm.blocks[block_id].ref_count > 1
            _slots(ax, i * step, y, n, bs, SHARED if shared else color, labels=[str(t) for t in seq.block(i)])
    # the physical pool in the middle
    py = 2.9
    ax.text(6.6, py + 1.35, "physical blocks (the pool)", fontsize=10)
    hashes = {0: "h0 = xxh64(\n  tokens 0-3)", 1: "h1 = xxh64(h0 |\n  tokens 4-7)",
              2: "h2 = xxh64(h1 |\n  tokens 8-11)"}
    for block in bm.blocks:
        x = 6.6 + (block.block_id % 3) * 2.4
        y = py - (block.block_id // 3) * 1.45 + 0.3
        holders = [name for seq, name, _, _ in rows if block.block_id in seq.block_table]
        color = SHARED if len(holders) > 1 else (A_COLOR if holders == ["A"] else
                                                B_COLOR if holders == ["B"] else "#e0e0e0")
        n = bs if block.hash != -1 else (0 if not holders else None)
        if n is None:
            seq = a if holders == ["A"] else b
            n = len(seq) - seq.block_table.index(block.block_id) * bs
        if not holders:
            n, color = bs, "#e0e0e0"
        _slots(ax, x, y, n, bs, color, w=0.3)
        label = f"block {block.block_id}: ref {block.ref_count}"
        if block.block_id in bm.free_block_ids:
            label = f"block {block.block_id}: free"
        ax.text(x, y - 0.27, label, fontsize=7.5)
        if block.block_id in hashes:
            ax.text(x, y + 0.5, hashes[block.block_id], fontsize=7, color="#555")
    # arrows from logical blocks to physical ones
    for seq, name, color, y in rows:
        for i, block_id in enumerate(seq.block_table):
            x = 6.6 + (block_id % 3) * 2.4
            yy = py - (block_id // 3) * 1.45 + 0.3
            start = (i * step + bs * 0.16, y if name == "A" else y + 0.42)
            ax.add_patch(FancyArrowPatch(start, (x + 0.1, yy + (0.42 if name == "A" else 0.0)), arrowstyle="->",
                                         mutation_scale=9, color=color, lw=1, connectionstyle="arc3,rad=0.05"))
    ax.text(-1.45, 2.0, "B's first two blocks hash to h0, h1\n(same tokens after the same prefix):\n"
                        "B reuses A's blocks 0 and 1 (ref count 2)\nand computes only its last 3 tokens.\n"
                        "Block 2 (h2) stays cached for a later\nprompt that continues A's text.",
            fontsize=8.5, va="center")
    ax.set_title("Prefix caching: equal prefixes share physical blocks (block size 4)", fontsize=11)
    return save(fig, path)


def prefill_savings(path: Path) -> Path:
    from nanovllm_course.ch05 import simulate
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(256)]
    counts = [1, 2, 4, 8, 16, 32]
    off, on = [], []
    for n in counts:
        prompts = [system + [rng.randrange(1000) for _ in range(64)] for _ in range(n)]
        off.append(simulate(prompts, 16, 4096, caching=False)["prefill_tokens"])
        on.append(simulate(prompts, 16, 4096, caching=True)["prefill_tokens"])
    fig, ax = figure(figsize=(6.5, 4))
    x = range(len(counts))
    ax.bar([i - 0.2 for i in x], off, width=0.4, label="prefix caching off")
    ax.bar([i + 0.2 for i in x], on, width=0.4, label="prefix caching on")
    ax.set_xticks(list(x), [str(n) for n in counts])
    ax.set_xlabel("requests (256-token shared system prompt + 64 own tokens), one arriving per step")
    ax.set_ylabel("prompt tokens the model computes")
    ax.set_title("Prefix caching computes the shared prompt once", fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [prefix_sharing(out_dir / "ch05_prefix_sharing.png"),
            prefill_savings(out_dir / "ch05_prefill_savings.png")]
