"""Figures of chapter 10 (CUDA graphs and fusion): the measured H200 decode step, eager vs graph replay, the
padding that the capture buckets cost, and round 3's hand-written decode kernels (read from
bench/results/kernels_round3_h200_2026-12-01.json and the step profiles of the round 2 and round 3 records, so
the figure redraws without a GPU).

The numbers are copied from bench/results/bench_h200.json ("graph_sweep": Qwen3-0.6B shape, random weights,
bf16, Triton attention, context 512, measured 2026-11-29 on one H200) and /work/shared facts (437-494 kernels
per decode step, measured 2026-11-30), so the figure redraws without a GPU.
"""
import json
from pathlib import Path

from nanovllm_course.figures import figure, save
from nanovllm_ref.engine.cuda_graph import graph_batch_sizes

# batch size -> (eager ms/step, graph replay ms/step), H200, context 512
SWEEP = {1: (50.93, 2.067), 2: (52.37, 2.161), 4: (52.85, 2.080), 8: (52.44, 2.122), 16: (51.89, 2.295),
         32: (51.76, 2.582), 64: (49.51, 3.058), 128: (49.34, 4.246), 256: (50.04, 6.752)}
KERNELS_PER_STEP = (437, 494)         # measured range over the bench workload's decode steps
WEIGHT_READ_MS = 0.28                 # 1.19 GB of weights at the measured 4.25 TB/s copy bandwidth
NUM_LAYERS = 28


def draw_launch_bound(out_dir: Path) -> Path:
    fig, (ax, bx) = figure(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.4, 1]})
    sizes = list(SWEEP)
    eager = [SWEEP[b][0] for b in sizes]
    graph = [SWEEP[b][1] for b in sizes]
    ax.plot(sizes, eager, "o-", color="#de2d26", label="eager: one Python launch per kernel")
    ax.plot(sizes, graph, "o-", color="#3182bd", label="CUDA graph replay: one launch per step")
    ax.axhline(WEIGHT_READ_MS, color="#636363", ls=":", lw=1)
    ax.text(1, WEIGHT_READ_MS * 1.15, "reading the weights once (0.28 ms)", fontsize=8, color="#636363")
    for b in (1, 64, 256):
        ax.annotate(f"{SWEEP[b][0] / SWEEP[b][1]:.0f}x", (b, SWEEP[b][1]), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=8, color="#3182bd")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("decode batch size (sequences)")
    ax.set_ylabel("ms per decode step (log)")
    ax.set_title("Qwen3-0.6B shape on one H200, bf16, context 512", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")

    lo, hi = KERNELS_PER_STEP
    mid = (lo + hi) / 2
    bars = [("eager", SWEEP[1][0], "#de2d26"), ("graph", SWEEP[1][1], "#3182bd"),
            ("weights\nfloor", WEIGHT_READ_MS, "#636363")]
    bx.bar([n for n, _, _ in bars], [v for _, v, _ in bars], color=[c for _, _, c in bars])
    for i, (_, v, _) in enumerate(bars):
        bx.text(i, v * 1.1, f"{v:.2f} ms", ha="center", fontsize=8)
    bx.set_yscale("log")
    bx.set_ylim(0.1, 150)
    bx.set_ylabel("ms per step at batch 1 (log)")
    bx.set_title(f"{lo}-{hi} kernels per step (about 16 per layer x {NUM_LAYERS})\n"
                 f"eager: ~{SWEEP[1][0] * 1000 / mid:.0f} us of host time per kernel", fontsize=10)
    return save(fig, out_dir / "ch10_launch_bound.png")


def _powers_of_two(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def draw_bucket_padding(out_dir: Path, max_num_seqs: int = 160) -> Path:
    fig, ax = figure(figsize=(10, 3.6))
    batches = list(range(1, max_num_seqs + 1))
    for sizes, color, label in ((graph_batch_sizes(max_num_seqs), "#3182bd",
                                 "engine buckets: 1, 2, 4, 8, then every 16, then max_num_seqs"),
                                (_powers_of_two(max_num_seqs), "#fdae6b", "powers of two only")):
        idle = [min(s for s in sizes if s >= b) - b for b in batches]
        ax.step(batches, idle, where="mid", color=color, label=f"{label} ({len(sizes)} graphs)")
    ax.axhline(15, color="#636363", ls=":", lw=1)
    ax.text(2, 17, "15 idle rows", fontsize=8, color="#636363")
    ax.set_xlabel(f"live batch size (max_num_seqs = {max_num_seqs})")
    ax.set_ylabel("idle (padding) rows replayed")
    ax.set_title("Each batch replays the smallest captured graph that fits; the rest of its rows are padding",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return save(fig, out_dir / "ch10_bucket_padding.png")


RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
KERNELS_ROUND3 = RESULTS / "kernels_round3_h200_2026-12-01.json"
STEP_PROFILES = {"round 2": RESULTS / "bench_h200_round2_2026-11-30.json",
                 "round 3": RESULTS / "bench_h200_round3_smoke_2026-12-01.json"}


def decode_kernel_facts() -> dict:
    """What chapter 10's fusion section and its figure use, from the committed H200 records:
    `layer`: {m: {"old"|"new"|"new+pdl": us per layer}} (one decoder layer of the Qwen3-0.6B shape, CUDA-graph
    replays); `kernels_per_layer`: {m: (old, new)} in that layer benchmark; `step_kernels_per_layer`:
    {"round 2"|"round 3": {batch: kernels per layer}} over a whole engine decode step (step_profile);
    `gemm`: {op: {m: (triton us, cublas us)}}; `elementwise`: {op: {m: (old us, new us)}}."""
    rec = json.loads(KERNELS_ROUND3.read_text())
    layer, kernels = {}, {}
    for row in rec["layer"]:
        layer.setdefault(row["m"], {})[row["variant"]] = row["us_per_layer"]
    for row in rec["layer_summary"]:
        kernels[row["m"]] = (row["old_kernels_per_layer"], row["new_kernels_per_layer"])
    gemm = {}
    for row in rec["gemm"]:
        if row["path"] == "triton+pdl":
            continue                      # the GEMM alone with PDL: the layer timings show what PDL buys
        path = "triton" if row["path"] == "triton" else "cublas"          # cuBLAS (+ Inductor's SiLU for gate_up)
        gemm.setdefault(row["op"], {}).setdefault(row["m"], {})[path] = row["us"]
    gemm = {op: {m: (v["triton"], v["cublas"]) for m, v in sorted(by_m.items()) if len(v) == 2}
            for op, by_m in gemm.items()}
    elementwise = {}
    for row in rec["elementwise"]:
        elementwise.setdefault(row["op"], {})[row["m"]] = (row["old_us"], row["new_us"])
    steps = {}
    for name, path in STEP_PROFILES.items():
        decode = json.loads(path.read_text())["step_profile"]["decode_steps"]
        steps[name] = {int(k[2:k.index("_")]): v["kernels_per_layer"] for k, v in decode.items()}
    return {"layer": dict(sorted(layer.items())), "kernels_per_layer": dict(sorted(kernels.items())),
            "step_kernels_per_layer": steps, "gemm": gemm, "elementwise": elementwise}


def draw_decode_kernels(out_dir: Path) -> Path:
    facts = decode_kernel_facts()
    fig, (ax, bx, cx) = figure(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1.25, 1, 1]})
    ms = [m for m in facts["layer"] if m <= 64]
    colors = {"old": "#bdbdbd", "new": "#3182bd", "new+pdl": "#08519c"}
    labels = {"old": "round 2: cuBLAS + Inductor kernels", "new": "round 3: hand-written decode kernels",
              "new+pdl": "round 3 + PDL"}
    width = 0.27
    for j, variant in enumerate(("old", "new", "new+pdl")):
        xs = [i + (j - 1) * width for i, m in enumerate(ms) if variant in facts["layer"][m]]
        ys = [facts["layer"][m][variant] for m in ms if variant in facts["layer"][m]]
        ax.bar(xs, ys, width=width, color=colors[variant], label=labels[variant])
        for x, y in zip(xs, ys):
            ax.text(x, y + 1, f"{y:.0f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(ms)), [f"M={m}\n{facts['kernels_per_layer'][m][0]:.0f} -> "
                                   f"{facts['kernels_per_layer'][m][1]:.0f} kernels" for m in ms], fontsize=8)
    ax.set_ylabel("us per decoder layer (CUDA-graph replay)")
    ax.set_ylim(0, max(max(v.values()) for m, v in facts["layer"].items() if m <= 64) * 1.25)
    steps = facts["step_kernels_per_layer"]
    ax.set_title(f"one decoder layer, Qwen3-0.6B shape, H200\n(a whole decode step at batch 1: "
                 f"{steps['round 2'][1]:.1f} -> {steps['round 3'][1]:.1f} kernels a layer)", fontsize=9)
    ax.legend(fontsize=7.5, loc="upper left")

    markers = {"qkv": "o", "o_proj": "s", "gate_up": "^", "down": "D", "lm_head": "x"}
    for op, by_m in facts["gemm"].items():
        m_values = list(by_m)
        bx.plot(m_values, [t / c for t, c in by_m.values()], marker=markers.get(op, "o"), label=op)
    bx.axhline(1.0, color="#636363", ls=":", lw=1)
    bx.text(20, 0.93, "as fast as cuBLAS", fontsize=8, color="#636363")
    bx.set_xscale("log", base=2)
    bx.set_xticks([1, 4, 16, 64], ["1", "4", "16", "64"])
    bx.set_xlabel("M (decode batch)")
    bx.set_ylabel("Triton time / cuBLAS time")
    bx.set_title("small-M Triton GEMM / cuBLAS (M=1, 4: GEMV form;\n16, 64: tl.dot): the engine's GEMV runs at "
                 "M=1 only", fontsize=9)
    bx.legend(fontsize=7.5, loc="upper right")

    ew = facts["elementwise"]
    names = {"qk_norm_rope_store": "q/k-norm + RoPE + KV store", "add_rms_norm": "add + RMSNorm (+ split-K sum)"}
    for op, style in (("qk_norm_rope_store", "-"), ("add_rms_norm", "--")):
        m_values = sorted(ew[op])
        cx.plot(m_values, [ew[op][m][0] for m in m_values], style, marker="o", color="#bdbdbd",
                label=f"{names[op]}: before")
        cx.plot(m_values, [ew[op][m][1] for m in m_values], style, marker="o", color="#3182bd",
                label=f"{names[op]}: one kernel")
    cx.set_xscale("log", base=2)
    cx.set_xticks(sorted(ew["qk_norm_rope_store"]), [str(m) for m in sorted(ew["qk_norm_rope_store"])])
    cx.set_xlabel("M (tokens in the step)")
    cx.set_ylabel("us per call")
    cx.set_title("the element-wise kernels, before vs fused", fontsize=9)
    cx.legend(fontsize=7, loc="upper left")
    return save(fig, out_dir / "ch10_decode_kernels_h200.png")


def draw(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    return [draw_launch_bound(out_dir), draw_bucket_padding(out_dir), draw_decode_kernels(out_dir)]
