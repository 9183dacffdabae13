"""Figures of chapter 02 (RoPE): rotation angle of each channel pair against position, for the course's
two models (SmolLM2-135M: head_dim 64, base 1e5; Qwen3: head_dim 128, base 1e6)."""
import math
from pathlib import Path

import torch

from nanovllm_course.figures import figure, save

# (name, head_dim, rope base, context length the model was trained for), from each model's config.json.
MODELS = [("SmolLM2-135M", 64, 1e5, 8192), ("Qwen3-0.6B", 128, 1e6, 40960)]


def slowest_period(head_dim: int, base: float) -> float:
    """Positions per full turn of the last (slowest) pair, i = head_dim/2 - 1: 2 pi / base^(-(d-2)/d)."""
    return 2 * math.pi / base ** (-(head_dim - 2) / head_dim)


def _tokens(n: float) -> str:
    return f"~{n / 1e6:.1f}M" if n >= 1e6 else f"~{n / 1e3:.0f}k"


def rotation_angles(path: Path, positions: int = 128) -> Path:
    from nanovllm_course.ch02 import reference_rope_cos_sin
    name, head_dim, base, _ = MODELS[0]
    cos, sin = reference_rope_cos_sin(head_dim, positions, base)
    angle = torch.atan2(sin, cos)                                  # wrapped to (-pi, pi]
    fig, (a0, a1) = figure(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1.3, 1]})
    im = a0.imshow(angle.T.numpy(), aspect="auto", origin="lower", cmap="twilight",
                   vmin=-math.pi, vmax=math.pi, interpolation="nearest")
    a0.grid(False)
    a0.set_xlabel("position p")
    a0.set_ylabel("channel pair i (pairs channel i with i + d/2)")
    a0.set_title(f"{name}: rotation angle p * theta_i, wrapped to (-pi, pi]\nhead_dim={head_dim}, "
                 f"base={base:g}", fontsize=10)
    cb = fig.colorbar(im, ax=a0, ticks=[-math.pi, 0, math.pi])
    cb.ax.set_yticklabels(["-pi", "0", "pi"])
    for (name, head_dim, base, context), marker in zip(MODELS, "os"):
        pairs = torch.arange(head_dim // 2)
        theta = base ** (-2 * pairs.double() / head_dim)
        period = slowest_period(head_dim, base)
        a1.semilogy(pairs.numpy(), (2 * math.pi / theta).numpy(), marker + "-", ms=3,
                    label=f"{name} (d={head_dim}, base {base:g}): last pair {_tokens(period)}")
        a1.axhline(context, color=a1.lines[-1].get_color(), ls=":", lw=1)
        a1.text(0, context * 1.2, f"{name} context: {context} tokens", fontsize=7.5, ha="left",
                color=a1.lines[-1].get_color())
    a1.axhline(positions, color="gray", ls="--", lw=1)
    a1.text(0, positions * 1.4, f"{positions} positions (left panel)", fontsize=8, color="gray")
    a1.set_xlabel("channel pair i")
    a1.set_ylabel("positions per full turn, 2 pi / theta_i")
    a1.set_title(f"pair 0 turns every ~6 tokens, the last pair once in\n"
                 f"{_tokens(slowest_period(*MODELS[0][1:3]))} (SmolLM2) or "
                 f"{_tokens(slowest_period(*MODELS[1][1:3]))} (Qwen3) tokens", fontsize=10)
    a1.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [rotation_angles(out_dir / "ch02_rotation_angles.png")]
