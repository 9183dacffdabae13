"""Figures of chapter 02 (RoPE): rotation angle of each channel pair against position."""
import math
from pathlib import Path

import torch

from nanovllm_course.figures import figure, save


def rotation_angles(path: Path, head_dim: int = 64, base: float = 10000.0, positions: int = 128) -> Path:
    from nanovllm_course.ch02 import reference_rope_cos_sin
    cos, sin = reference_rope_cos_sin(head_dim, positions, base)
    angle = torch.atan2(sin, cos)                                  # wrapped to (-pi, pi]
    fig, (a0, a1) = figure(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1.3, 1]})
    im = a0.imshow(angle.T.numpy(), aspect="auto", origin="lower", cmap="twilight",
                   vmin=-math.pi, vmax=math.pi, interpolation="nearest")
    a0.grid(False)
    a0.set_xlabel("position p")
    a0.set_ylabel("channel pair i (pairs channel i with i + d/2)")
    a0.set_title(f"rotation angle p * theta_i, wrapped to (-pi, pi]\nhead_dim={head_dim}, base={base:g}",
                 fontsize=10)
    cb = fig.colorbar(im, ax=a0, ticks=[-math.pi, 0, math.pi])
    cb.ax.set_yticklabels(["-pi", "0", "pi"])
    pairs = torch.arange(head_dim // 2)
    theta = base ** (-2 * pairs.double() / head_dim)
    a1.semilogy(pairs.numpy(), (2 * math.pi / theta).numpy(), "o-", ms=3, label="wavelength 2pi / theta_i")
    a1.axhline(positions, color="gray", ls="--", lw=1)
    a1.text(0, positions * 1.4, f"{positions} positions (left panel)", fontsize=8, color="gray")
    a1.set_xlabel("channel pair i")
    a1.set_ylabel("positions per full turn")
    a1.set_title("pair 0 turns every ~6 tokens, the last pair\nonce in ~50k tokens", fontsize=10)
    a1.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [rotation_angles(out_dir / "ch02_rotation_angles.png")]
