"""Figures of chapter 03 (the Qwen3 model): GQA head sharing, a packed prefill batch with its block-diagonal
causal mask, and the row layout of the fused qkv_proj / gate_up_proj weights."""
from pathlib import Path

import numpy as np
from matplotlib.patches import FancyBboxPatch, Rectangle

from nanovllm_course.figures import figure, save

Q_COLOR, K_COLOR, V_COLOR = "#9ecae1", "#f6c26b", "#a1d99b"
SEQ_COLORS = ["#6baed6", "#fd8d3c", "#74c476", "#9e9ac8"]


def gqa_heads(path: Path) -> Path:
    num_heads, num_kv = 8, 2
    group = num_heads // num_kv
    fig, ax = figure(figsize=(8, 3.4))
    ax.axis("off")
    ax.grid(False)
    ax.set_xlim(-0.5, num_heads)
    ax.set_ylim(-0.6, 3.2)
    kv_x = [group * j + (group - 1) / 2 for j in range(num_kv)]
    for h in range(num_heads):
        ax.add_patch(FancyBboxPatch((h, 2.2), 0.8, 0.6, boxstyle="round,pad=0.03", fc=Q_COLOR, ec="#333"))
        ax.text(h + 0.4, 2.5, f"q{h}", ha="center", va="center", fontsize=9)
        ax.plot([h + 0.4, kv_x[h // group] + 0.4], [2.2, 1.0], color="#555", lw=1)
    for j, x in enumerate(kv_x):
        ax.add_patch(FancyBboxPatch((x - 0.35, 0.3), 1.5, 0.7, boxstyle="round,pad=0.03", fc=K_COLOR, ec="#333"))
        ax.text(x + 0.4, 0.65, f"k{j}, v{j}", ha="center", va="center", fontsize=9)
    ax.text(-0.4, 2.95, f"{num_heads} query heads", fontsize=9)
    ax.text(-0.4, -0.35, f"{num_kv} KV heads: the only ones stored in the KV cache "
                         f"(query head h reads KV head h // {group})", fontsize=9)
    ax.set_title(f"Grouped-query attention: groups of {group} query heads share one key/value head", fontsize=10)
    return save(fig, path)


def packed_batch(path: Path) -> Path:
    lengths = [3, 5, 2]
    total = sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    mask = np.zeros((total, total))
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        for q in range(s, e):
            mask[q, s:q + 1] = i + 1
    fig, (ax0, ax1) = figure(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1.25, 1]})
    for ax in (ax0, ax1):
        ax.grid(False)
    # left: the packed input
    ax0.axis("off")
    ax0.set_xlim(-2.7, total + 0.3)
    ax0.set_ylim(-0.2, 4.9)
    positions = [p for n in lengths for p in range(n)]
    for t in range(total):
        seq = int(np.searchsorted(cu, t, side="right") - 1)
        ax0.add_patch(Rectangle((t, 2.6), 0.95, 0.8, fc=SEQ_COLORS[seq], ec="#333"))
        ax0.text(t + 0.47, 3.0, f"t{t}", ha="center", va="center", fontsize=8)
        ax0.text(t + 0.47, 2.2, str(positions[t]), ha="center", va="center", fontsize=9)
    ax0.text(-2.6, 3.0, "input_ids", va="center", fontsize=9)
    ax0.text(-2.6, 2.2, "positions", va="center", fontsize=9)
    for c in cu:
        ax0.plot([c - 0.025, c - 0.025], [1.55, 3.5], color="#c0392b", lw=1.5)
        ax0.text(c - 0.025, 1.2, str(int(c)), ha="center", fontsize=9, color="#c0392b")
    ax0.text(-2.6, 1.2, "cu_seqlens", fontsize=9, color="#c0392b")
    for i, (s, n) in enumerate(zip(cu[:-1], lengths)):
        ax0.text(s + n / 2, 0.6, f"prompt {i}", ha="center", fontsize=9, color=SEQ_COLORS[i])
    last = cu[1:] - 1
    for t in last:
        ax0.annotate("", xy=(t + 0.47, 4.25), xytext=(t + 0.47, 3.45), arrowprops=dict(arrowstyle="->", color="#333"))
        ax0.text(t + 0.47, 4.35, "logits", ha="center", fontsize=8)
    ax0.text(-2.6, 3.85, "last token\nof each prompt", fontsize=8, va="center")
    ax0.text(-2.6, 0.0, f"logits rows = cu_seqlens[1:] - 1 = {list(map(int, last))}", fontsize=8.5)
    ax0.set_title("One prefill step: all prompts packed into one [num_tokens] batch", fontsize=10)
    # right: the mask
    from matplotlib.colors import ListedColormap
    ax1.imshow(mask, cmap=ListedColormap(["#f7f7f7"] + SEQ_COLORS[:len(lengths)]), vmin=0, vmax=len(lengths))
    ax1.set_xticks(range(total))
    ax1.set_yticks(range(total))
    ax1.set_xlabel("key token")
    ax1.set_ylabel("query token")
    ax1.set_title("Who attends to whom: block-diagonal and causal", fontsize=10)
    return save(fig, path)



def _stacked_weight(ax, x_mid, x_label, title, total_rows, parts):
    """One fused [total_rows, 64] weight drawn as row blocks, each fed by its checkpoint tensor."""
    y0, scale = 3.6, 2.6 / total_rows
    ax.text(x_mid, 3.75, title, ha="center", fontsize=9)
    row = 0
    for name, rows, color, sid in parts:
        h = rows * scale
        ax.add_patch(Rectangle((x_mid - 0.7, y0 - h), 1.4, h, fc=color, ec="#333"))
        ax.text(x_mid, y0 - h / 2, f"rows {row}..{row + rows - 1}", ha="center", va="center", fontsize=8)
        ax.text(x_label, y0 - h / 2, f"{name}.weight\n[{rows}, 64], shard {sid}", va="center", fontsize=8)
        ax.annotate("", xy=(x_mid - 0.75, y0 - h / 2), xytext=(x_mid - 1.25, y0 - h / 2),
                    arrowprops=dict(arrowstyle="->"))
        y0 -= h
        row += rows

def fused_weights(path: Path) -> Path:
    fig, ax = figure(figsize=(9, 3.6))
    ax.axis("off")
    ax.grid(False)
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 4)
    # qkv: q 4 heads x 16, k 2 x 16, v 2 x 16 (the tiny model) drawn as row blocks of a tall matrix
    _stacked_weight(ax, 2.6, 0.2, "qkv_proj.weight  [128, 64]", 128,
                    [("q_proj", 64, Q_COLOR, '"q"'), ("k_proj", 32, K_COLOR, '"k"'), ("v_proj", 32, V_COLOR, '"v"')])
    ax.text(0.2, 0.45, "offset of k = q_size = 4 heads x 16\noffset of v = q_size + kv_size", fontsize=8)
    _stacked_weight(ax, 7.6, 5.0, "gate_up_proj.weight  [256, 64]", 256,
                    [("gate_proj", 128, "#fdae6b", "0"), ("up_proj", 128, "#c6dbef", "1")])
    ax.text(8.5, 2.0, "SiluAndMul:\nsilu(first half)\n * second half", fontsize=8, va="center")
    ax.set_title("The checkpoint stores separate matrices; the engine runs one fused matmul for each group "
                 "(tiny Qwen3: hidden 64)", fontsize=10)
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [gqa_heads(out_dir / "ch03_gqa_heads.png"),
            packed_batch(out_dir / "ch03_packed_batch.png"),
            fused_weights(out_dir / "ch03_fused_weights.png")]
