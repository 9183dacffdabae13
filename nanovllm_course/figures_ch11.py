"""Figures of chapter 11 (benchmarking), drawn from the committed H200 results in bench/results/*.json (no GPU
needed): the roofline of a Qwen3-0.6B decode step with the measured CUDA-graph sweep, the throughput table
(the floor, nanovllm_ref, HF continuous batching, TP=2, batch-1) with the published nano-vllm vs vLLM
numbers, and where the floor's seconds come from against the measured run."""
from pathlib import Path

from nanovllm_course import ch11
from nanovllm_course.figures import figure, save
from nanovllm_bench.floor import model_stats

BLUE, ORANGE, GREY, GREEN, RED, PURPLE = "#3182bd", "#e6550d", "#969696", "#31a354", "#de2d26", "#756bb1"


def roofline(out: Path) -> Path:
    run = ch11.h200_result("bench_h200.json")
    bw, flops = run["machine"]["copy_bandwidth_Bps"], run["machine"]["matmul_flops"]
    st = model_stats(ch11.qwen3_06b_config())
    sweep = run["graph_sweep"]
    ctx = sweep[0]["context"]
    fig, (ax1, ax2) = figure(1, 2, figsize=(11.5, 4.3))

    # left: the classic roofline, attainable FLOP/s against arithmetic intensity
    xs = [2 ** (i / 8) for i in range(-8, 8 * 12)]
    ax1.plot(xs, [min(flops, bw * x) / 1e12 for x in xs], color="k", lw=1.5, label="H200 roof (measured copy bw, bf16 matmul)")
    ridge = flops / bw
    ax1.axvline(ridge, color=GREY, ls=":", lw=1)
    ax1.text(ridge * 1.1, 3, f"ridge {ridge:.0f} FLOP/B", fontsize=8, color="#555555")
    for batch_ctx, color, marker, label in ((0, BLUE, "s", "model: decode step, context 0"),
                                             (ctx, GREEN, "^", f"model: decode step, context {ctx}")):
        bs = [r["batch_size"] for r in sweep]
        inten = [b * (2 * st["params"] + st["attn_flops_coef"] * batch_ctx) /
                 (st["weight_bytes"] + b * batch_ctx * st["kv_bytes_per_token"]) for b in bs]
        ax1.plot(inten, [min(flops, bw * i) / 1e12 for i in inten], marker, color=color, ms=5, mfc="none", label=label)
    meas_i, meas_f = [], []
    for r in sweep:
        b = r["batch_size"]
        f = b * (2 * st["params"] + st["attn_flops_coef"] * ctx)
        meas_i.append(f / (st["weight_bytes"] + b * ctx * st["kv_bytes_per_token"]))
        meas_f.append(f / (r["graph_ms"] / 1000) / 1e12)
    ax1.plot(meas_i, meas_f, "o-", color=ORANGE, ms=5, label=f"measured: nanovllm_ref step, context {ctx}")
    for i, f, r in zip(meas_i, meas_f, sweep):
        if r["batch_size"] in (1, 16, 256):
            ax1.annotate(f"B={r['batch_size']}", (i, f), fontsize=7, textcoords="offset points", xytext=(4, -10))
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax1.set_ylabel("TFLOP/s")
    ax1.set_title("Roofline of one decode step (Qwen3-0.6B, H200)", fontsize=10)
    ax1.legend(fontsize=7, loc="lower right")

    # right: what it means in tokens per second against the batch size
    bs = [2 ** (i / 4) for i in range(0, 4 * 11 + 1)]
    for c, color, label in ((0, BLUE, "roofline, context 0 (weights only)"),
                            (ctx, GREEN, f"roofline, context {ctx}")):
        ax2.plot(bs, [b / ch11.step_time(st, b, bw, flops, c) for b in bs], color=color, lw=1.5, label=label)
    ax2.plot([r["batch_size"] for r in sweep], [r["batch_size"] / (r["graph_ms"] / 1000) for r in sweep], "o-",
             color=ORANGE, ms=5, label=f"measured (CUDA graphs), context {ctx}")
    b0 = ch11.reference_compute_bound_batch(st, bw, flops, 0)
    ax2.axvline(b0, color=BLUE, ls=":", lw=1)
    ax2.text(b0 * 1.08, 2e3, f"compute-bound\nfrom B = {b0:.0f}\n(context 0)", fontsize=8, color=BLUE)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("decode batch size B")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("Decode throughput: roofline vs measured", fontsize=10)
    ax2.legend(fontsize=7, loc="upper left")
    return save(fig, out / "ch11_roofline.png")


def throughput_table(out: Path) -> Path:
    run = ch11.h200_result("bench_h200.json")
    rows = [("physical floor (this workload, round 1's machine)", run["floor"]["floor_tok_s"], GREY)]
    names = {"nanovllm_ref[triton,cudagraph]": "nanovllm_ref, CUDA graphs", "nanovllm_ref[triton,eager]":
             "nanovllm_ref, eager", "nanovllm_ref[triton,cudagraph,tp2]": "nanovllm_ref, CUDA graphs, TP=2 (2 GPUs)",
             "hf_transformers[continuous_batching]": "HF transformers continuous batching"}
    names.update({"nanovllm_ref[triton:graph]": "nanovllm_ref, CUDA graphs", "nanovllm_ref[flash_attn:graph]":
                  "nanovllm_ref, flash_attn (vLLM's FA3), CUDA graphs", "nano-vllm": "upstream nano-vllm"})
    batch1 = {"batch-1 decode [triton,cudagraph]", "batch-1 decode nanovllm_ref[triton:graph]"}
    for r in ch11.h200_results():
        if r["record"] not in ("round 1", "round 2", "round 3, peers"):
            continue                               # the TP host, the seams check, the first look, the repeat
        if r["name"] in names:
            color = ORANGE if r["name"].startswith("hf") else RED if r["name"] == "nano-vllm" else BLUE
            rows.append((f"{names[r['name']]} ({r['record']})", r["tok_s"], color))
        elif r["name"] in batch1:
            rows.append((f"batch-1 decode, CUDA graphs ({r['record']})", r["tok_s"], PURPLE))
    v = ch11.VLLM_EARLIER
    rows.append((f"vLLM {v['version']} (same day, earlier lease; ours then {v['ours_then']:,})", v["tok_s"], GREEN))
    fig, (ax1, ax2) = figure(1, 2, figsize=(12, 4.2), gridspec_kw=dict(width_ratios=[1.7, 1]))
    ys = range(len(rows))
    ax1.barh(list(ys), [v for _, v, _ in rows], color=[c for _, _, c in rows])
    for y, (_, v, _) in zip(ys, rows):
        ax1.text(v * 1.05, y, f"{v:,.0f}", va="center", fontsize=8)
    ax1.set_yticks(list(ys), [n for n, _, _ in rows], fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xscale("log")
    ax1.set_xlim(300, 1.2e5)
    ax1.set_xlabel("output tokens / s (log scale)")
    ax1.set_title("H200, 256 requests, 133,966 output tokens (committed results)", fontsize=10)

    pub = ch11.PUBLISHED["rows"]
    x = range(len(pub))
    ax2.bar([i - 0.2 for i in x], [r["nano_vllm"] for r in pub], 0.4, color=BLUE, label="nano-vllm")
    ax2.bar([i + 0.2 for i in x], [r["vllm"] for r in pub], 0.4, color=GREEN, label="vLLM")
    for i, r in zip(x, pub):
        ax2.text(i - 0.2, r["nano_vllm"], f"{r['nano_vllm']:,}", ha="center", va="bottom", fontsize=8)
        ax2.text(i + 0.2, r["vllm"], f"{r['vllm']:,}", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(list(x), [r["hardware"] for r in pub], fontsize=8)
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("Published, same workload (nano-vllm README)", fontsize=10)
    ax2.legend(fontsize=8)
    return save(fig, out / "ch11_throughput_table.png")


def floor_breakdown(out: Path) -> Path:
    run = ch11.h200_result("bench_h200.json")
    fl = run["floor"]
    best = max((r for r in run["runs"] if r.get("tok_s") and r["name"].startswith("nanovllm")),
               key=lambda r: r["tok_s"])
    fig, ax = figure(figsize=(6.5, 3.2))
    left = 0.0
    for key, color, label in (("kv_read_s", GREEN, "read K/V (decode)"), ("weight_read_s", RED, "read weights (decode)"),
                              ("prefill_s", PURPLE, "prefill FLOPs")):
        ax.barh([1], [fl[key]], left=left, color=color, label=f"{label}: {fl[key]:.2f} s")
        left += fl[key]
    ax.barh([0], [best["seconds"]], color=BLUE, label=f"measured nanovllm_ref: {best['seconds']:.2f} s")
    ax.text(left, 1, f"  {left:.2f} s", va="center", fontsize=8)
    ax.set_yticks([0, 1], ["measured", "floor"])
    ax.set_xlabel("seconds for the workload (H200)")
    ax.set_title(f"The floor's parts vs the run ({best['pct_of_floor']:.0f} % of floor)", fontsize=10)
    ax.legend(fontsize=7.5, loc="lower right", bbox_to_anchor=(1.0, 1.12), ncols=2, frameon=False)
    return save(fig, out / "ch11_floor_breakdown.png")


def draw(out_dir: Path) -> list[Path]:
    out = Path(out_dir)
    return [roofline(out), throughput_table(out), floor_breakdown(out)]
