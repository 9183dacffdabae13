"""Figures of chapter 07 (the scheduler), from the model-free simulator in `nanovllm_course.ch07`: step Gantt
charts of static vs continuous batching, of preemption under a tight block budget, and of the reference's
prefill-first policy vs a vLLM-V1-style mixed token budget; and the overlap (async) scheduling timeline, drawn
from the committed H200 records in bench/results/ (so it redraws without a GPU)."""
import json
from pathlib import Path

from matplotlib.patches import Patch, Rectangle

from nanovllm_course import ch07
from nanovllm_course.figures import figure, save

COLORS = {"prefill": "#3182bd", "decode": "#74c476", "preempted": "#de2d26", "stalled": "#fdae6b",
          "waiting": "#e5e5e5", "idle": "#bdbdbd"}
LABELS = {"idle": "idle slot (done, batch still running)", "stalled": "stalled (running, not in the step)"}

# (arrival step, prompt tokens, max_tokens): mixed output lengths, a few late arrivals
WORKLOAD = [(0, 6, 10), (0, 4, 3), (0, 8, 5), (0, 5, 2), (1, 6, 4), (2, 3, 6), (3, 7, 3), (4, 5, 5)]
# tight cache: four requests that each grow to 5 blocks of 4 tokens, 10 blocks in all
PREEMPT_WORKLOAD = [(0, 8, 12), (0, 8, 12), (0, 8, 12), (0, 8, 12)]
PREEMPT_CONFIG = dict(kvcache_block_size=4, num_kvcache_blocks=10, max_num_batched_tokens=64, max_num_seqs=4)
# three requests decoding, then two long prompts arrive; budget 16 tokens per step
MIXED_WORKLOAD = [(0, 4, 24), (0, 4, 24), (0, 4, 24), (5, 48, 4), (11, 40, 4)]
MIXED_CONFIG = dict(max_num_batched_tokens=16, kvcache_block_size=4, num_kvcache_blocks=64, max_num_seqs=8)


def gantt(ax, trace, n, title, show_waiting=True):
    """One row per request, one column per step, coloured by what the request did in that step."""
    for s, row in enumerate(trace):
        for i in range(n):
            what = None
            if i in row["preempted"]:
                what = "preempted"
            elif i in row["phase"]:
                what = row["phase"][i]
            elif i in row.get("idle", []):
                what = "idle"
            elif i in row.get("stalled", []):
                what = "stalled"
            elif show_waiting and i in row.get("waiting", []):
                what = "waiting"
            if what:
                ax.add_patch(Rectangle((s, i - 0.4), 1, 0.8, fc=COLORS[what], ec="white", lw=0.6))
                if what == "preempted":
                    ax.text(s + 0.5, i, "X", ha="center", va="center", color="white", fontsize=7, weight="bold")
                if what == "prefill" and row["tokens"].get(i, 0) > 1:
                    ax.text(s + 0.5, i, str(row["tokens"][i]), ha="center", va="center", color="white",
                            fontsize=6)
    ax.set_xlim(0, len(trace))
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n), [f"req {i}" for i in range(n)], fontsize=8)
    ax.set_xlabel("engine step")
    ax.grid(False)
    ax.set_title(title, fontsize=10)


def _legend(ax, keys):
    ax.legend(handles=[Patch(fc=COLORS[k], label=LABELS.get(k, k)) for k in keys], fontsize=7.5,
              loc="upper right", ncols=len(keys),
              bbox_to_anchor=(1.0, -0.22), frameon=False)


def static_vs_continuous(path: Path) -> Path:
    n = len(WORKLOAD)
    static = ch07.simulate_static(WORKLOAD, batch_size=4)
    cont = ch07.simulate(WORKLOAD, max_num_seqs=4, max_num_batched_tokens=64)
    fig, (a, b) = figure(2, 1, figsize=(9, 6.2), sharex=True)
    s1, s2 = ch07.summary(static, WORKLOAD), ch07.summary(cont, WORKLOAD)
    gantt(a, static, n, f"static batching, 4 per batch: {s1['steps']} steps, mean latency "
                        f"{s1['mean_latency']:.1f} steps")
    gantt(b, cont, n, f"continuous batching (the reference scheduler, max_num_seqs 4): {s2['steps']} steps, "
                      f"mean latency {s2['mean_latency']:.1f} steps")
    a.set_xlabel("")
    _legend(b, ["prefill", "decode", "stalled", "waiting", "idle"])
    fig.suptitle("Same 8 requests (numbers: prompt tokens computed in that step)", fontsize=11)
    return save(fig, path)


def preemption(path: Path) -> Path:
    n = len(PREEMPT_WORKLOAD)
    trace = ch07.simulate(PREEMPT_WORKLOAD, **PREEMPT_CONFIG)
    fig, ax = figure(figsize=(9, 2.8))
    s = ch07.summary(trace, PREEMPT_WORKLOAD)
    gantt(ax, trace, n, f"4 requests of 8 + 12 tokens, a cache of 10 blocks of 4: {s['preemptions']} "
                        "preemptions, each victim recomputed (P) when blocks free up")
    _legend(ax, ["prefill", "decode", "preempted", "waiting"])
    return save(fig, path)


def v1_mixed(path: Path) -> Path:
    n = len(MIXED_WORKLOAD)
    ref = ch07.simulate(MIXED_WORKLOAD, **MIXED_CONFIG)
    mixed = ch07.simulate(MIXED_WORKLOAD, ch07.MixedScheduler, **MIXED_CONFIG)
    steps = max(len(ref), len(mixed))
    fig, axes = figure(2, 2, figsize=(12, 5.4), sharex=True, gridspec_kw={"height_ratios": [1.3, 1]})
    for col, (trace, name) in enumerate(((ref, "reference: prefill first, each step all-prefill or all-decode"),
                                         (mixed, "vLLM V1 style: one 16-token budget, running sequences first"))):
        s = ch07.summary(trace, MIXED_WORKLOAD)
        gantt(axes[0][col], trace, n, f"{name}\n{s['steps']} steps; longest decode stall "
                                      f"{s['max_decode_gap']} steps", show_waiting=False)
        pre = [sum(t for i, t in row["tokens"].items() if row["phase"][i] == "prefill") for row in trace]
        dec = [sum(t for i, t in row["tokens"].items() if row["phase"][i] == "decode") for row in trace]
        ax = axes[1][col]
        x = [k + 0.5 for k in range(len(trace))]
        ax.bar(x, pre, width=0.9, color=COLORS["prefill"], label="prefill tokens")
        ax.bar(x, dec, width=0.9, bottom=pre, color=COLORS["decode"], label="decode tokens")
        ax.axhline(MIXED_CONFIG["max_num_batched_tokens"], color="#555", lw=0.8, ls="--")
        ax.set_xlim(0, steps)
        ax.set_ylabel("tokens in the step")
        ax.set_xlabel("engine step")
        ax.legend(fontsize=7.5, loc="upper right")
    axes[0][0].set_xlabel("")
    axes[0][1].set_xlabel("")
    fig.legend(handles=[Patch(fc=COLORS[k], label=LABELS.get(k, k)) for k in ("prefill", "decode", "stalled")],
               fontsize=8, loc="lower center", ncols=3, bbox_to_anchor=(0.5, -0.04), frameon=False)
    return save(fig, path)


RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
ROUND2 = RESULTS / "bench_h200_round2_2026-11-30.json"          # synchronous loop, host time outside the runner
ROUND3 = RESULTS / "bench_h200_round3_smoke_2026-12-01.json"    # async scheduling on: device vs wall per step


def overlap_facts() -> dict:
    """The numbers the overlap figure and chapter 07's text use, read from the committed H200 records:
    host_ms (round 2: host time outside the model runner per step, synchronous loop), and per batch size of
    the round-3 step profile (context 512, async scheduling on) graph_step_ms (wall time per step), gpu_step_ms
    (the step's graph replayed back to back: device time) and host_not_overlapped_ms (their difference), with
    round 2's graph_step_ms beside them (`round2_step_ms`)."""
    r2 = json.loads(ROUND2.read_text())["step_profile"]
    r3 = json.loads(ROUND3.read_text())["step_profile"]["decode_steps"]
    work = r2["workload"]
    facts = {"host_ms": 1000 * work["host_outside_run_s"] / (work["prefill_steps"] + work["decode_steps"]),
             "batches": {}}
    for key, row in r3.items():
        batch = int(key[2:key.index("_")])
        facts["batches"][batch] = {"graph_step_ms": row["graph_step_ms"], "gpu_step_ms": row["gpu_step_ms"],
                                   "host_not_overlapped_ms": row["host_not_overlapped_ms"],
                                   "round2_step_ms": r2["decode_steps"][key]["graph_step_ms"]}
    return facts


def overlap_timeline(path: Path, steps: int = 5) -> Path:
    facts = overlap_facts()
    h, d = facts["host_ms"], facts["batches"][1]["gpu_step_ms"]
    fig, (ax, bx) = figure(1, 2, figsize=(12.5, 3.9), gridspec_kw={"width_ratios": [1.7, 1]})
    lanes = [("sync: host", False, "host"), ("sync: GPU", False, "gpu"),
             ("async: host", True, "host"), ("async: GPU", True, "gpu")]
    host, device = [h] * steps, [d] * steps
    for y, (name, overlap, lane) in enumerate(lanes):
        timeline = ch07.reference_overlap_timeline(host, device, overlap)
        for i, (launch, start, end) in enumerate(timeline):
            lo, hi = (launch - h, launch) if lane == "host" else (start, end)
            color = "#fdae6b" if lane == "host" else "#74c476"
            ax.add_patch(Rectangle((lo, y - 0.35), hi - lo, 0.7, fc=color, ec="white", lw=0.8))
            ax.text((lo + hi) / 2, y, str(i), ha="center", va="center", fontsize=7)
        if lane == "gpu":
            wall = ch07.wall_ms(timeline)
            ax.annotate(f"{wall:.2f} ms for {steps} steps", (wall, y), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=8)
    ax.set_yticks(range(len(lanes)), [name for name, _, _ in lanes], fontsize=8)
    ax.set_ylim(len(lanes) - 0.4, -0.6)
    ax.set_xlim(0, steps * (h + d) * 1.22)
    ax.set_xlabel("ms")
    ax.grid(False)
    ax.set_title(f"batch 1: host {h:.2f} ms a step (round 2, measured), GPU {d:.2f} ms (round 3, measured);\n"
                 "timelines from ch07.reference_overlap_timeline (E7.4)", fontsize=9)
    ax.legend(handles=[Patch(fc="#fdae6b", label="host: bookkeeping, schedule, prepare, launch"),
                       Patch(fc="#74c476", label="GPU: the step's graph")], fontsize=7.5, loc="lower right",
              bbox_to_anchor=(1.0, -0.3), ncols=2, frameon=False)

    batches = sorted(facts["batches"])
    x = list(range(len(batches)))
    gpu = [facts["batches"][b]["gpu_step_ms"] for b in batches]
    exposed = [facts["batches"][b]["host_not_overlapped_ms"] for b in batches]
    bx.bar(x, gpu, width=0.55, color="#74c476", label="device time (graph replayed back to back)")
    bx.bar(x, exposed, width=0.55, bottom=gpu, color="#de2d26", label="host time not overlapped")
    bx.scatter(x, [facts["batches"][b]["round2_step_ms"] for b in batches], marker="_", s=600, color="#3182bd",
               zorder=3, label="round 2 step (synchronous, no decode kernels)")
    for i, b in enumerate(batches):
        row = facts["batches"][b]
        top = max(row["graph_step_ms"], row["round2_step_ms"])
        bx.text(i, top + 0.25, f"{row['graph_step_ms']:.2f} ms\n"
                f"({row['host_not_overlapped_ms']:.3f} exposed)", ha="center", fontsize=7)
    bx.set_xticks(x, [f"batch {b}" for b in batches])
    bx.set_ylim(0, max(facts["batches"][b]["graph_step_ms"] for b in batches) * 1.55)
    bx.set_ylabel("ms per decode step (context 512)")
    bx.set_title("measured on the H200, round 3 (async scheduling on)", fontsize=9)
    bx.legend(fontsize=7, loc="upper left")
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    return [static_vs_continuous(out_dir / "ch07_static_vs_continuous.png"),
            preemption(out_dir / "ch07_preemption.png"),
            v1_mixed(out_dir / "ch07_v1_mixed.png"),
            overlap_timeline(out_dir / "ch07_overlap_timeline.png")]
