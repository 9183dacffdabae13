"""Figures drawn from one benchmark record (`--figures DIR`): throughput of every measured row (median,
min-max bars, the floor as a line), batch-1 decode, where the floor's seconds come from, and the CUDA-graph
sweep when the record has one. Files: bench_throughput_<tag>.png, bench_batch1_<tag>.png,
bench_floor_<tag>.png, cuda_graph_speedup_<tag>.png."""
import os

COLORS = {"nanovllm_ref": "#4c72b0", "vllm": "#55a868", "nano-vllm": "#8172b2", "hf": "#dd8452"}


def _color(row) -> str:
    return COLORS.get(row.get("peer") or ("nanovllm_ref" if row["name"].startswith("nanovllm_ref") else "hf"), "#999999")


def _label(row) -> str:
    v = row.get("versions") or {}
    version = v.get("peer") or v.get("commit")
    return f"{row['name']} ({version})" if version and not row["name"].startswith("nanovllm_ref") else row["name"]


def draw_figures(record: dict, outdir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(outdir, exist_ok=True)
    paths, tag = [], record["tag"]

    def save(fig, stem):
        fig.tight_layout()
        paths.append(os.path.join(outdir, f"{stem}{tag}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    runs = [r for r in record["runs"] if r.get("tok_s")]
    title = (f"{record['workload']['num_requests']} requests, {record['workload']['output_tokens']:,} output tokens, "
             f"{record['machine']['device_name']}, {record['date']}")
    if runs:
        fig, ax = plt.subplots(figsize=(9, 0.5 * len(runs) + 1.8))
        vals = [r["tok_s"] for r in runs]
        err = [[r["tok_s"] - r.get("min_tok_s", r["tok_s"]) for r in runs],
               [r.get("max_tok_s", r["tok_s"]) - r["tok_s"] for r in runs]]
        ax.barh([_label(r) for r in runs], vals, xerr=err, capsize=3, color=[_color(r) for r in runs])
        floor = record.get("floor", {}).get("floor_tok_s")
        if floor:
            ax.axvline(floor, color="k", ls="--", lw=1)
            ax.text(floor, len(runs) - 0.5, f" floor {floor:,.0f}", va="top", fontsize=8)
        for i, (v, r) in enumerate(zip(vals, runs)):
            ax.text(r.get("max_tok_s", v), i, f" {v:,.0f} (median of {r.get('repeats', 1)})", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("output tokens / s (bars: min-max of the timed runs)")
        ax.set_title(title, fontsize=9)
        save(fig, "bench_throughput_")
    b1 = [r for r in runs if r.get("batch1_tok_s")]
    if b1:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(b1) + 1.8))
        ax.barh([_label(r) for r in b1], [r["batch1_tok_s"] for r in b1], color=[_color(r) for r in b1])
        for i, r in enumerate(b1):
            ax.text(r["batch1_tok_s"], i, f" {r['batch1_tok_s']:,.0f}", va="center", fontsize=8)
        p = b1[0].get("batch1", {})
        ax.invert_yaxis()
        ax.set_xlabel(f"output tokens / s, one request ({p.get('prompt_tokens')} prompt tokens, "
                      f"{p.get('new_tokens')} new)")
        ax.set_title("Batch-1 decode, " + title, fontsize=9)
        save(fig, "bench_batch1_")
    fl = record.get("floor")
    ours = [r for r in runs if r["name"].startswith("nanovllm_ref")]
    if fl and ours:
        fig, ax = plt.subplots(figsize=(6, 4))
        bottom = 0.0
        for part, color in zip(["kv_read_s", "weight_read_s", "prefill_s"], ["#55a868", "#c44e52", "#8172b2"]):
            ax.bar(["physical floor"], [fl[part]], bottom=bottom, color=color, label=part.replace("_s", ""))
            bottom += fl[part]
        best = max(ours, key=lambda r: r["tok_s"])
        ax.bar([best["name"]], [best["seconds"]], color=COLORS["nanovllm_ref"])
        ax.set_ylabel("seconds for the workload")
        ax.legend(fontsize=8)
        ax.set_title("Where the floor comes from (roofline of the workload)", fontsize=10)
        save(fig, "bench_floor_")
    sweep = record.get("graph_sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["batch_size"] for r in sweep]
        ax.plot(xs, [r["eager_ms"] for r in sweep], "o-", label="eager")
        ax.plot(xs, [r["graph_ms"] for r in sweep], "o-", label="CUDA graph")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch size")
        ax.set_ylabel("ms per decode step")
        for r in sweep:
            ax.annotate(f"{r['speedup']:.1f}x", (r["batch_size"], r["graph_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(0, -10), ha="center")
        ax.legend()
        ax.set_title("CUDA-graph speedup of one decode step", fontsize=10)
        save(fig, "cuda_graph_speedup_")
    return paths
