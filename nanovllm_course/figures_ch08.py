"""Figure of chapter 08 (the sampler): how temperature, top-k and top-p reshape one next-token distribution."""
from pathlib import Path

import torch

from nanovllm_course.ch08 import reference_temperature_probs, reference_top_k_top_p
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


def draw(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [reshape(out_dir / "ch08_reshape.png")]
