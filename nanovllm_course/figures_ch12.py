"""Figures of chapter 12 (serving):

- ch12_engine_loop.png: the server's two threads, the HTTP handlers on the event loop and the engine loop
  that owns the engine, and what passes between them (nanovllm_ref/entrypoints/openai/engine_loop.py);
- ch12_engine_core.png: the split (engine/core.py, engine/core_client.py, engine/output_processor.py): the front
  end in the server's process, the engine core's busy loop in its own, and the msgspec messages between them
  over two ZMQ sockets;
- ch12_detok_window.png: the incremental detokenizer's window (prefix and read offsets) sliding over a
  byte-level stream in which a character is split over three byte tokens, from the reference step;
- ch12_serving_latency.png: TTFT and TPOT against output throughput, drawn from the committed serving record
  (`ch12.serve_record()`: bench/results/serve_h200.json, our server against `vllm serve` in one H200 call, when
  it is committed, else the CPU record);
- ch12_serving_latency_cpu.png: the same from the CPU record (bench/results/serve_cpu.json: three engine
  settings of our server on SmolLM2), section 12.5's trade-off.
"""
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from nanovllm_course import ch12
from nanovllm_course.figures import figure, save
from nanovllm_ref.engine.token_bytes import byte_decoder

BLUE, GREEN, ORANGE, GREY, RED = "#3182bd", "#31a354", "#e6550d", "#969696", "#de2d26"


def _box(ax, x, y, w, h, text, color, fontsize=8.5):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="none",
                                alpha=0.18))
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc="none", ec=color,
                                lw=1.2))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, a, b, text="", color="black", offset=(0, 0.12), rad=0.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=11, color=color, lw=1.1,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], text, ha="center", va="bottom",
                fontsize=7.5, color=color)


def engine_loop(path: Path) -> Path:
    fig, ax = figure(figsize=(10.5, 4.8))
    ax.set_xlim(0, 10.5)
    ax.set_ylim(-0.25, 4.6)
    ax.axis("off")
    ax.add_patch(Rectangle((0.05, 0.2), 4.6, 4.2, fc="none", ec=GREY, ls="--", lw=0.8))
    ax.text(0.15, 4.25, "event loop thread (asyncio: FastAPI + uvicorn)", fontsize=8, color=GREY, va="top")
    ax.add_patch(Rectangle((6.0, 0.2), 4.4, 4.2, fc="none", ec=GREY, ls="--", lw=0.8))
    ax.text(6.1, 4.25, "engine thread (owns the engine)", fontsize=8, color=GREY, va="top")
    for i, y in enumerate((3.0, 2.0, 1.0)):
        _box(ax, 0.3, y, 1.5, 0.6, f"client {i + 1}\n(HTTP, SSE)", GREY)
        _box(ax, 2.6, y, 1.8, 0.6, f"handler {i + 1}: checks,\nqueue, stream", BLUE)
        _arrow(ax, (1.8, y + 0.38), (2.6, y + 0.38))
        _arrow(ax, (2.6, y + 0.2), (1.8, y + 0.2), color=BLUE)
    _box(ax, 4.85, 2.45, 1.0, 1.1, "submit,\nabort:\npending\n(one lock)", ORANGE, fontsize=7.5)
    _arrow(ax, (4.4, 3.3), (4.85, 3.2), "", ORANGE)
    _arrow(ax, (4.4, 2.3), (4.85, 2.75), "", ORANGE)
    _box(ax, 6.4, 2.6, 3.7, 1.2, "tick: apply_pending (E12.1)\naborts, then adds (a refused group\nis undone), "
                                 "then one engine.step()", GREEN)
    _arrow(ax, (5.85, 3.0), (6.4, 3.1), "", ORANGE)
    _box(ax, 6.4, 0.6, 3.7, 1.2, "engine.step() -> RequestOutputs\n(cumulative text: the detokenizer, E12.2)",
         GREEN)
    _arrow(ax, (8.25, 2.6), (8.25, 1.8))
    _box(ax, 4.85, 0.7, 1.0, 0.9, "group\nqueues", BLUE, fontsize=7.5)
    _arrow(ax, (6.4, 1.15), (5.85, 1.15), "", BLUE)
    ax.text(6.13, 0.68, "outputs\n(call_soon_\nthreadsafe)", ha="center", fontsize=6.5, color=BLUE)
    _arrow(ax, (4.85, 1.15), (4.4, 1.3), "", BLUE)
    _arrow(ax, (4.85, 1.4), (4.4, 2.2), "", BLUE)
    ax.text(5.35, 1.75, "deltas ->\nSSE (E12.3)", ha="center", fontsize=7, color=BLUE)
    ax.text(5.25, -0.12, "one GIL: the engine's Python and the handlers' take turns", ha="center", fontsize=7.5,
            color=RED)
    ax.set_title("Continuous batching across HTTP clients: requests join and leave between steps", fontsize=10)
    return save(fig, path)


def _label(tok, t) -> str:
    """A token as the figure shows it: its text, or its bytes in hex when it is not a whole character."""
    piece = tok.convert_ids_to_tokens(t)
    if ch12.REPLACEMENT in tok.decode([t]):
        alphabet = byte_decoder()           # GPT-2's byte-level alphabet, character -> byte
        return " ".join(f"{alphabet[c]:02X}" for c in piece if c in alphabet)
    return piece.replace("Ġ", "␣")


def engine_core(path: Path) -> Path:
    fig, ax = figure(figsize=(10.5, 4.6))
    ax.set_xlim(0, 10.5)
    ax.set_ylim(-0.1, 4.5)
    ax.axis("off")
    ax.add_patch(Rectangle((0.05, 0.2), 4.5, 4.1, fc="none", ec=GREY, ls="--", lw=0.8))
    ax.text(0.15, 4.2, "server process: the front end (one GIL)", fontsize=8, color=GREY, va="top")
    ax.add_patch(Rectangle((6.75, 0.2), 3.65, 4.1, fc="none", ec=GREY, ls="--", lw=0.8))
    ax.text(6.85, 4.2, "engine core process (its own GIL)", fontsize=8, color=GREY, va="top")
    _box(ax, 0.3, 2.75, 4.0, 1.0, "event loop: HTTP handlers, JSON, SSE\n(tokenizing on a worker thread)", BLUE)
    _box(ax, 0.3, 0.5, 4.0, 1.8, "front end (LLMEngine + OutputProcessor):\nadd_request -> EngineCoreRequest\n"
                                 "per step (E12.4): append token ids,\ndetokenize (E12.2), find stop strings\n"
                                 "-> abort in the core; RequestOutputs", GREEN, fontsize=8)
    _arrow(ax, (2.5, 2.75), (2.5, 2.3), "", BLUE)
    _arrow(ax, (2.2, 2.3), (2.2, 2.75), "", GREEN)
    _box(ax, 7.0, 0.5, 3.2, 3.25, "busy loop (run_engine_core):\n\n1. take every add and abort\n   that arrived\n"
                                  "2. schedule, execute, update\n   (token ids only)\n3. send EngineCoreOutputs\n"
                                  "4. again; block on the input\n   socket when idle", ORANGE, fontsize=8)
    _arrow(ax, (4.3, 2.0), (7.0, 2.9))
    ax.text(5.55, 2.95, "ZMQ PUSH -> PULL (ipc):\nEngineCoreRequest,\nEngineCoreAbort", ha="center", va="bottom",
            fontsize=7.2)
    _arrow(ax, (7.0, 1.3), (4.3, 1.1), color=RED)
    ax.text(5.65, 0.3, "EngineCoreOutputs, one per step\n(msgpack): per sample the new\ntoken ids, finish reason",
            ha="center", va="bottom", fontsize=7.2, color=RED)
    return save(fig, path)


def detok_window(path: Path) -> Path:
    """The window of E12.2 over a byte-level stream: ' Paris € ok' with € (E2 82 AC) split over three byte
    tokens."""
    tok = ch12.byte_level_tokenizer()
    decode = ch12.decoder_of(tok)
    prompt = tok.encode("The capital is")
    completion = tok.encode(" Paris € ok")
    prefix, read, ids = ch12.context_start(tok, prompt), len(prompt), list(prompt)
    rows = []
    for t in completion:
        ids.append(t)
        before = (prefix, read)
        new, prefix, read = ch12.reference_detokenize_step(decode, ids, prefix, read)
        rows.append((list(ids), before, new))
    n = len(prompt) + len(completion)
    fig, ax = figure(figsize=(10.5, 0.55 * len(rows) + 1.1))
    for r, (ids_r, (p, rd), new) in enumerate(rows):
        y = len(rows) - 1 - r
        for j, t in enumerate(ids_r):
            if j < p:
                color, alpha = GREY, 0.15
            elif j < rd:
                color, alpha = BLUE, 0.45
            else:
                color, alpha = ORANGE, 0.6
            ax.add_patch(Rectangle((j, y + 0.1), 0.95, 0.8, fc=color, alpha=alpha, ec="white"))
            text = _label(tok, t)
            ax.text(j + 0.47, y + 0.5, text if len(text) <= 5 else text[:4] + "…", ha="center", va="center",
                    fontsize=6.5)
        shown = repr(new) if new else "'' (held back: the decode ends in U+FFFD)"
        ax.text(n + 0.3, y + 0.5, f"emits {shown}", va="center", fontsize=8, color=GREEN if new else RED)
    ax.set_xlim(0, n + 7.5)
    ax.set_ylim(0, len(rows))
    ax.axis("off")
    ax.set_title("E12.2: each step decodes ids[prefix:read] (blue, context) and ids[prefix:] (+ orange, new); "
                 "the text is the difference", fontsize=9.5)
    ax.text(0, -0.35, "grey: out of the window for good; € is three byte tokens (E2 82 AC): nothing comes out "
                      "until the third arrives", fontsize=8, color=GREY)
    return save(fig, path)


def serving_latency(path: Path, which=None) -> Path:
    """TTFT and TPOT against output throughput from a serving record: `which` (file name, record), default
    ch12.serve_record() (the H200 record once committed)."""
    name, record = which or ch12.serve_record()
    panels = [("ttft_ms", "time to first token (ms)"), ("tpot_ms", "time per output token (ms)")]
    fig, axes = figure(1, 2, figsize=(11, 4.2))
    for (key, label), ax in zip(panels, axes):
        for i, (server, data) in enumerate(sorted(record["servers"].items())):
            runs = [r for r in data["runs"] if r["completed"]]
            x = [r["output_throughput"] for r in runs]
            color = f"C{i}"
            ax.plot(x, [r[key]["p50"] for r in runs], "o-", color=color, label=f"{server}: p50")
            ax.plot(x, [r[key]["p99"] for r in runs], "s--", color=color, alpha=0.5, label=f"{server}: p99")
            for r, xi in zip(runs, x):
                ax.annotate("all" if r["rate"] == "inf" else f"{r['rate']:g}/s", (xi, r[key]["p50"]),
                            textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7.5, loc="lower center", ncols=min(len(labels), 3), frameon=False,
               bbox_to_anchor=(0.5, -0.13))
    load = record.get("load", {})
    where = "H200, Qwen3-0.6B shape" if "h200" in name else "CPU (2 cores), SmolLM2-135M-Instruct"
    fig.suptitle(f"{where}: {load.get('num_requests')} requests, Poisson arrivals (labels: requests/s) "
                 f"[bench/results/{name}]", fontsize=10)
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [engine_loop(out_dir / "ch12_engine_loop.png"), engine_core(out_dir / "ch12_engine_core.png"),
            detok_window(out_dir / "ch12_detok_window.png"),
            serving_latency(out_dir / "ch12_serving_latency.png"),
            serving_latency(out_dir / "ch12_serving_latency_cpu.png", ch12.cpu_serve_record())]
