"""Figure of chapter 13 (capstone): C.4's throughput on the H200, the reference engine's parts against the
capstone's (the course's solutions exported as a student's), drawn from the JSON that bench/ch13_gpu.py
writes. Skipped until bench/results/ch13_gpu_h200.json is committed."""
import json
from pathlib import Path

from nanovllm_course.figures import figure, save

REPO = Path(__file__).resolve().parents[1]
GPU_JSON = REPO / "bench" / "results" / "ch13_gpu_h200.json"
LABELS = {"reference": "reference parts", "yours": "your parts\n(the solutions, exported)"}
COLORS = {"reference": "#6baed6", "yours": "#fd8d3c"}
LABEL_GAP = 0.03            # between the highest dot and the median's label, as a fraction of the axis top


def capstone_throughput(path: Path, data: dict) -> Path:
    """Median output tok/s per engine (bars), each timed run (dots); an engine that failed is marked with the
    first words of its error instead of a bar."""
    engines = data["engines"]
    fig, ax = figure(figsize=(6.4, 4.2))
    names = list(engines)
    top = max([x for rec in engines.values() for x in rec.get("tok_s", [])] or [1.0])
    for i, name in enumerate(names):
        rec = engines[name]
        if rec.get("median_tok_s"):
            ax.bar(i, rec["median_tok_s"], width=0.55, color=COLORS.get(name, "#999"))
            ax.plot([i] * len(rec["tok_s"]), rec["tok_s"], "o", color="#333", ms=4)
            # the label sits above the highest timed run, so no dot covers it
            ax.text(i, max([rec["median_tok_s"]] + rec["tok_s"]) + LABEL_GAP * top, f"{rec['median_tok_s']:,.0f}",
                    ha="center", va="bottom", fontsize=9.5)
        if rec.get("error"):
            ax.text(i, 0.5 * top, "failed:\n" + rec["error"][:60], ha="center", va="center", fontsize=8,
                    color="#c00", wrap=True)
    ax.set_xticks(range(len(names)), [LABELS.get(n, n) for n in names])
    ax.set_xlim(-0.7, len(names) - 0.3)
    ax.set_ylim(0, 1.18 * top)
    ax.set_ylabel("output tokens / s (median of the timed runs)")
    w = data.get("workload", {})
    ax.set_title(f"C.4: {w.get('requests', '?')} requests, T = {w.get('temperature', '?')}, ignore_eos, "
                 f"CUDA graphs {'on' if data.get('engine_args', {}).get('enforce_eager') is False else 'off'}\n"
                 f"{data.get('model', '')}; {data.get('device', '?')}, {data.get('date', '')}", fontsize=9.5)
    return save(fig, path)


def draw(out_dir: Path) -> list[Path]:
    if not GPU_JSON.is_file():      # measured on a GPU by bench/ch13_gpu.py; skipped until then
        return []
    return [capstone_throughput(Path(out_dir) / "ch13_capstone_h200.png", json.loads(GPU_JSON.read_text()))]
