"""Figures of chapter 07 (the scheduler), all from the model-free simulator in `nanovllm_course.ch07`:
step Gantt charts of static vs continuous batching, of preemption under a tight block budget, and of the
reference's prefill-first policy vs a vLLM-V1-style mixed token budget."""
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


def draw(out_dir: Path) -> list[Path]:
    return [static_vs_continuous(out_dir / "ch07_static_vs_continuous.png"),
            preemption(out_dir / "ch07_preemption.png"),
            v1_mixed(out_dir / "ch07_v1_mixed.png")]
