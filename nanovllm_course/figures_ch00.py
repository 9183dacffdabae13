"""Figures of chapter 00 (tour): the architecture map of the engine, with the chapter of each part."""
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from nanovllm_course.figures import figure, save

COLORS = {"api": "#d9d9d9", "engine": "#f6c26b", "model": "#9ecae1", "mem": "#a1d99b", "sample": "#fdae9f"}


def _box(ax, x, y, w, h, title, sub, color, chapter):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04", fc=color, ec="#333", lw=1.2))
    ax.text(x + w / 2, y + h * 0.62, title, ha="center", va="center", fontsize=10.5, weight="bold")
    ax.text(x + w / 2, y + h * 0.27, sub, ha="center", va="center", fontsize=7.5, color="#333")
    if chapter:
        ax.text(x + w - 0.05, y + h - 0.07, chapter, ha="right", va="top", fontsize=7.5, color="#7f1d1d",
                weight="bold")


def _arrow(ax, a, b, text=None, rad=0.0, color="#333"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="->", mutation_scale=14, lw=1.3, color=color,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((a[0] + b[0]) / 2 + 0.08, (a[1] + b[1]) / 2, text, fontsize=7.5, color=color, va="center")


def engine_map(path: Path) -> Path:
    fig, ax = figure(figsize=(11, 6.2))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 6.4)
    ax.axis("off")
    ax.grid(False)
    _box(ax, 0.3, 5.2, 2.9, 0.9, "LLM", "llm.py: generate(prompts, params)", COLORS["api"], "ch 00")
    _box(ax, 0.3, 3.6, 2.9, 1.1, "LLMEngine", "engine/llm_engine.py\nadd_request, step() loop", COLORS["engine"],
         "ch 07")
    _box(ax, 4.0, 3.6, 3.0, 1.1, "Scheduler", "engine/scheduler.py\nwhich sequences run this step", COLORS["engine"],
         "ch 07")
    _box(ax, 7.8, 3.6, 2.9, 1.1, "BlockManager", "engine/block_manager.py\nKV blocks, prefix cache",
         COLORS["mem"], "ch 05")
    _box(ax, 0.3, 1.6, 2.9, 1.5, "ModelRunner", "engine/model_runner.py\nbatch -> tensors (ch 04),\n"
         "CUDA graphs (ch 10), TP ranks (ch 09)", COLORS["engine"], "ch 04")
    _box(ax, 4.0, 0.3, 4.4, 2.8, "", "", "#eef5fb", None)
    ax.text(4.2, 2.88, "Model: N layers", va="center", fontsize=9.5, weight="bold")
    ax.text(5.9, 2.88, "models/qwen3.py, llama.py", va="center", fontsize=7.5, color="#333")
    ax.text(8.35, 3.03, "ch 03", ha="right", va="top", fontsize=7.5, color="#7f1d1d", weight="bold")
    layers = [("embedding", "layers/embed_head.py", "ch 09"), ("RMSNorm", "layers/layernorm.py", "ch 01"),
              ("attention", "attention.py; RoPE: ch 02", "ch 04"),
              ("MLP", "linear.py, activation.py", "ch 03"), ("LM head", "logits of last tokens", "ch 09")]
    for i, (name, sub, ch) in enumerate(layers):
        _box(ax, 4.2, 2.25 - i * 0.45, 4.0, 0.38, "", "", COLORS["model"], None)
        ax.text(4.35, 2.44 - i * 0.45, name, fontsize=8.5, weight="bold", va="center")
        ax.text(5.55, 2.44 - i * 0.45, sub, fontsize=7, va="center", color="#333")
        ax.text(8.15, 2.44 - i * 0.45, ch, fontsize=7, va="center", ha="right", color="#7f1d1d", weight="bold")
    _box(ax, 8.8, 1.6, 1.95, 1.2, "Sampler", "layers/sampler.py\ngreedy / temperature", COLORS["sample"], "ch 08")
    _box(ax, 8.8, 0.3, 1.95, 0.9, "KV cache", "[blocks, block, heads, d]\nper layer", COLORS["mem"], "ch 04")
    _box(ax, 4.0, 5.2, 6.7, 0.9, "attention back-ends + kernels",
         "attn/torch_backend.py (reference), attn/triton_backend.py + kernels/ (ch 06), flash-attn",
         "#e5e5f7", "ch 06")

    _arrow(ax, (1.75, 5.2), (1.75, 4.7), "prompts")
    _arrow(ax, (3.2, 4.15), (4.0, 4.15), "")
    _arrow(ax, (7.0, 4.15), (7.8, 4.15), "")
    ax.text(3.6, 4.2, "schedule", fontsize=6.5, ha="center", va="bottom")
    ax.text(7.4, 4.2, "allocate", fontsize=6.5, ha="center", va="bottom")
    _arrow(ax, (1.75, 3.6), (1.75, 3.1), "run(seqs, is_prefill)")
    _arrow(ax, (3.2, 2.35), (4.0, 2.35), "")
    _arrow(ax, (8.4, 2.2), (8.8, 2.2), "")
    _arrow(ax, (8.4, 0.75), (8.8, 0.75), "")
    # sampled tokens go back to the scheduler: up from the Sampler, left through the gap above the model box
    # (below the BlockManager), then up into the Scheduler
    red = "#7f1d1d"
    ax.plot([9.5, 9.5, 6.5], [2.84, 3.33, 3.33], color=red, lw=1.3, solid_capstyle="butt")
    _arrow(ax, (6.5, 3.33), (6.5, 3.56), color=red)
    ax.text(6.62, 3.36, "next token ids -> postprocess()", fontsize=7, color=red, va="bottom")
    ax.text(5.5, 6.3, "One engine step: schedule a batch, run the model once, sample one token per sequence, repeat",
            ha="center", fontsize=10.5)
    return save(fig, path)




# -- decode throughput against batch size ------------------------------------------------------------------
# Decode tokens/s of SmolLM2-135M-Instruct's shapes (30 layers, hidden 576), 16-token prompts, 64 new tokens
# per sequence, measured with `measure_decode_throughput` below: on an H200 with random weights
# (load_format="dummy": same shapes, so the same speed), on the CPU with the real checkpoint and
# torch.set_num_threads(1). Re-measure on other hardware and paste the dicts here to redraw.
DECODE_THROUGHPUT = {
    "NVIDIA H200, bf16, CUDA graphs, Triton attention": {1: 327, 2: 610, 4: 1207, 8: 2383, 16: 4561, 32: 8702, 64: 16475, 128: 30480, 256: 51621},
    "1 CPU core (x86-64, shared), fp32": {1: 24.0, 2: 29.0, 4: 57.8, 8: 89.1, 16: 104.7, 32: 120.0, 64: 102.8},
}


def measure_decode_throughput(model_dir: str, device: str, batch_sizes, **engine_args) -> dict:
    """{batch size: decode tokens/s} for the model in `model_dir` on `device`, engine defaults otherwise."""
    from nanovllm_ref import LLM
    from nanovllm_course.ch00 import decode_throughput
    llm = LLM(str(model_dir), device=device, max_model_len=512, **engine_args)
    try:
        return decode_throughput(llm, batch_sizes, repeats=3 if device == "cuda" else 1)
    finally:
        llm.exit()


def decode_throughput_figure(path: Path, data: dict | None = None) -> Path:
    data = data or DECODE_THROUGHPUT
    fig, (a0, a1) = figure(1, 2, figsize=(11, 4))
    for (label, series), marker in zip(data.items(), "os^"):
        b = sorted(int(k) for k in series)
        tps = [series[k] if k in series else series[str(k)] for k in b]
        a0.loglog(b, tps, marker + "-", label=label)
        a1.loglog(b, [1000 * bb / t for bb, t in zip(b, tps)], marker + "-", label=label)
    a0.set_xlabel("sequences decoded together (batch size)")
    a0.set_ylabel("decode throughput, tokens/s")
    a0.set_title("Batching multiplies throughput ...", fontsize=10)
    a1.set_xlabel("sequences decoded together (batch size)")
    a1.set_ylabel("time of one decode step, ms")
    a1.set_title("... because on the GPU a step costs about the same for 1 or 256 sequences", fontsize=10)
    for ax in (a0, a1):
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M decode, 16-token prompts, 64 new tokens each", fontsize=10.5)
    fig.tight_layout()
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [engine_map(out_dir / "ch00_engine_map.png"),
            decode_throughput_figure(out_dir / "ch00_decode_throughput.png")]
