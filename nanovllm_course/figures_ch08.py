"""Figures of chapter 08 (the sampler): how temperature, top-k and top-p reshape one next-token distribution;
what the penalties do to one row of logits."""
from pathlib import Path

import torch

from nanovllm_course.ch08 import reference_apply_penalties, reference_temperature_probs, reference_top_k_top_p
from nanovllm_course.figures import figure, save


def reshape(path: Path) -> Path:
    """16 tokens with fixed logits (sorted, most likely first). Left: softmax(logits / T) for T = 0.5, 1, 2.
    Right: T = 1, then top_k = 5, or top_p = 0.8 (renormalised; removed tokens at 0)."""
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(1, 16, generator=g) * 1.3).sort(descending=True).values
    x = torch.arange(16)
    fig, axes = figure(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    for t, color in [(0.5, "#08519c"), (1.0, "#6baed6"), (2.0, "#bdd7e7")]:
        p = reference_temperature_probs(logits, torch.tensor([t]))[0]
        ax.plot(x, p, "o-", color=color, lw=1.6, ms=4, label=f"T = {t}")
    ax.set_title("temperature: softmax(logits / T)")
    ax.set_xlabel("token (most likely first)")
    ax.set_ylabel("probability")
    ax.legend()
    ax = axes[1]
    p1 = reference_temperature_probs(logits, torch.tensor([1.0]))
    pk = reference_top_k_top_p(p1, torch.tensor([5]), None)[0]
    pp = reference_top_k_top_p(p1, None, torch.tensor([0.8], dtype=torch.float64))[0]
    w = 0.28
    ax.bar(x - w, p1[0], w, color="#bdbdbd", label="T = 1")
    ax.bar(x, pk, w, color="#fd8d3c", label="top_k = 5")
    ax.bar(x + w, pp, w, color="#74c476", label=f"top_p = 0.8 ({int((pp > 0).sum())} tokens)")
    ax.set_title("top-k / top-p: drop the tail, renormalise")
    ax.set_xlabel("token (most likely first)")
    ax.legend()
    return save(fig, path)


def penalties(path: Path) -> Path:
    """8 tokens with fixed logits, some seen in the prompt, some in the output (counts under the bars). Left:
    repetition_penalty 2 (positive logits halve, negative ones double: both move down). Right: frequency 0.5
    and presence 0.5 (output tokens only; a token seen 3 times loses 3 * 0.5 + 0.5)."""
    logits = torch.tensor([[2.4, 1.6, 1.0, 0.4, -0.6, -1.2, 2.0, -0.2]])
    prompt = torch.tensor([[True, False, True, False, True, False, False, False]])
    counts = torch.tensor([[0, 3, 1, 0, 0, 2, 0, 1]], dtype=torch.int32)
    one = torch.ones(1)
    rep = reference_apply_penalties(logits, prompt, counts, 0 * one, 0 * one, 2 * one)[0]
    pf = reference_apply_penalties(logits, prompt, counts, 0.5 * one, 0.5 * one, one)[0]
    labels = ["+".join(([("P")] if prompt[0, i] else []) + ([f"O x{int(counts[0, i])}"] if counts[0, i] else []))
              or "-" for i in range(8)]
    x = torch.arange(8)
    fig, axes = figure(1, 2, figsize=(11, 3.8))
    w = 0.38
    for ax, after, color, title in [(axes[0], rep, "#e6550d", "repetition_penalty = 2 (prompt and output)"),
                                    (axes[1], pf, "#3182bd", "frequency = presence = 0.5 (output only)")]:
        ax.bar(x - w / 2, logits[0], w, color="#bdbdbd", label="logit")
        ax.bar(x + w / 2, after, w, color=color, label="penalised")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(x, labels)
        ax.set_title(title)
        ax.set_xlabel("token (P: in the prompt, O xN: N times in the output)")
        ax.legend()
    axes[0].set_ylabel("logit")
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [reshape(out_dir / "ch08_reshape.png"), penalties(out_dir / "ch08_penalties.png")]
