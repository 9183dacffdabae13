"""Chapter 13, section C.4 on a GPU: the capstone's engine (solutions/ exported as if they were a student's
notebooks) against the reference engine on the benchmark workload; writes JSON and a figure drawn from it.

    python bench/ch13_gpu.py                       # on a CUDA machine, from the repository root (< 240 s on an H200)
    python bench/ch13_gpu.py --cpu-smoke --out D   # the same code path on a CPU: tiny model, 4 short requests

Writes OUT/ch13_gpu_h200.json and OUT/ch13_capstone_h200.png, where OUT is --out, else $OUT, else
artifacts/ch13_gpu/. The JSON holds the date, device, torch / triton versions, the workload, and per engine
the tok/s of each timed run, their median and which parts were the student's (or the error text, when that
engine failed: one engine failing does not stop the other). Commit the JSON as
bench/results/ch13_gpu_h200.json; `python -m nanovllm_course figures 13` then redraws
figures/ch13_capstone_h200.png from it on any machine (nanovllm_course/figures_ch13.py).

Workload (C.4 of the notebook): Qwen3-0.6B's shape with dummy weights (nanovllm_bench.workload.make_model_folder),
make_workload scaled to 64 requests, temperature 0.6, ignore_eos, CUDA graphs on. Each engine: one warm-up
generate (4 requests), then 3 timed runs of the whole workload; throughput = output tokens / seconds.
The runs share one engine, as in the notebook's cell, and prefix caching is on: the warm-up's 4 prompts are
the workload's first 4, and runs 2 and 3 find every prompt cached. Both engines get the same, and it only
shortens prefill, a small share of this decode-heavy workload; `nanovllm_bench` instead times each run
in a fresh engine.
The student's engine uses capstone.gpu_parts (the course's choice of parts with cuda=True): on a GPU that is
chapter 06's Triton decode kernel, where the CPU sections of the notebook run chapter 04's PyTorch decode.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))                   # nanovllm_ref and nanovllm_course from this checkout

JSON_NAME = "ch13_gpu_h200.json"
FIGURE_NAME = "ch13_capstone_h200.png"
GPU = dict(requests=64, runs=3, warmup_requests=4, temperature=0.6,
           engine=dict(enforce_eager=False, max_model_len=2048))
SMOKE = dict(requests=4, runs=3, warmup_requests=2, temperature=0.6,
             engine=dict(enforce_eager=True, device="cpu", max_model_len=256, kvcache_block_size=16),
             workload=dict(min_len=16, max_len=48, min_out=4, max_out=12))


def workload(settings):
    from nanovllm_bench.workload import make_workload
    return make_workload(settings["requests"], **settings.get("workload", {}))


def run_engine(path, parts, prompts, max_tokens, settings, deadline=None) -> dict:
    """One engine: a warm-up generate, then up to settings["runs"] timed runs of the workload (fewer if the
    next one would pass `deadline`, a time.monotonic() value). Never raises: a failure is returned as
    {"error": "<type>: <message>", "traceback": ...} beside the runs that finished."""
    import torch
    from nanovllm_ref import LLM, SamplingParams
    rec = dict(tok_s=[], seconds=[], output_tokens=None, median_tok_s=None, error=None)
    sps = [SamplingParams(temperature=settings["temperature"], max_tokens=n, ignore_eos=True) for n in max_tokens]
    cuda = torch.cuda.is_available() and settings["engine"].get("device", "cuda") != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        with LLM(path, parts=parts, load_format="dummy", **settings["engine"]) as llm:
            rec.update(backend=llm.model_runner.backend_name, cuda_graphs=not llm.model_runner.enforce_eager)
            w = settings["warmup_requests"]
            llm.generate(prompts[:w], sps[:w], use_tqdm=False)
            for _ in range(settings["runs"]):
                if deadline is not None and rec["seconds"] and time.monotonic() + 1.2 * rec["seconds"][-1] > deadline:
                    rec["note"] = f"stopped after {len(rec['seconds'])} timed runs: the script's time budget"
                    break
                sync()
                start = time.perf_counter()
                outs = llm.generate(prompts, sps, use_tqdm=False)
                sync()
                seconds = time.perf_counter() - start
                tokens = sum(len(o["token_ids"]) for o in outs)
                rec["output_tokens"] = tokens
                rec["seconds"].append(seconds)
                rec["tok_s"].append(tokens / seconds)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        rec["error"] = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
        rec["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if cuda:
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    if rec["tok_s"]:
        rec["median_tok_s"] = statistics.median(rec["tok_s"])
    return rec


def student_parts(smoke: bool, out_dir: str):
    """Export solutions/ the way a student's chapters are exported (the capstone's round trip, into a fresh
    package) and assemble the capstone with the course's choice of parts. Returns (parts, labels of the parts
    that are the student's). out_dir is unused (kept for the command line); the export goes to a temp folder."""
    from nanovllm_course import ch13
    cap = ch13.assemble(ch13.SOLUTIONS, ch13.reference_choose_parts)
    # on a CPU chapter 06's Triton kernels would only be interpreted: run (and name) what the notebook's CPU runs
    choice, parts = (cap.choice, cap.cpu_parts) if smoke else (cap.gpu_choice, cap.gpu_parts)
    return parts, [ch13.part_label(c) for c in choice.values()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "artifacts" / "ch13_gpu"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, 4 short requests, on the CPU")
    ap.add_argument("--budget-s", type=float, default=220.0, help="stop timing new runs past this many seconds")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    import torch
    if not args.cpu_smoke:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --cpu-smoke); the committed figure is figures/ch13_capstone_h200.png")
            return 1
        os.environ.pop("TRITON_INTERPRET", None)    # compiled kernels, whatever the shell says
    settings = SMOKE if args.cpu_smoke else GPU
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    from nanovllm_bench.workload import make_model_folder
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = dict(date=time.strftime("%Y-%m-%d"),
                device="cpu (smoke test)" if args.cpu_smoke else torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton_version, python=platform.python_version(),
                mode="cpu-smoke" if args.cpu_smoke else "gpu",
                model="tiny Qwen3 (dummy weights)" if args.cpu_smoke else "Qwen3-0.6B shape, dummy weights, bf16",
                engine_args=settings["engine"], engines={})
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model_folder("tiny" if args.cpu_smoke else "qwen3-0.6b", str(Path(tmp) / "model"))
        prompts, max_tokens = workload(settings)
        data["workload"] = dict(requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                                output_tokens=sum(max_tokens), temperature=settings["temperature"],
                                ignore_eos=True, seed=0, warmup_requests=settings["warmup_requests"],
                                timed_runs=settings["runs"])
        from nanovllm_ref import Parts
        data["engines"]["reference"] = dict(students_parts=[],
                                            **run_engine(path, Parts(), prompts, max_tokens, settings, deadline))
        try:
            parts, labels = student_parts(args.cpu_smoke, tmp)
        except Exception as exc:
            data["engines"]["yours"] = dict(students_parts=None, tok_s=[], seconds=[], median_tok_s=None,
                                            error=f"assembling the capstone failed: {type(exc).__name__}: {exc}"[:500],
                                            traceback=traceback.format_exc()[-4000:])
        else:
            data["engines"]["yours"] = dict(students_parts=labels,
                                            **run_engine(path, parts, prompts, max_tokens, settings, deadline))
    data["total_seconds"] = round(time.monotonic() - t0, 1)
    json_path = out / JSON_NAME
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {json_path}")
    for who, rec in data["engines"].items():
        runs = ", ".join(f"{x:,.0f}" for x in rec["tok_s"])
        print(f"{who:9s}: " + (f"median {rec['median_tok_s']:,.0f} tok/s (runs {runs})" if rec["tok_s"] else "no run")
              + (f"; FAILED {rec['error']}" if rec["error"] else ""))
    try:
        from nanovllm_course.figures_ch13 import capstone_throughput
        print(f"wrote {capstone_throughput(out / FIGURE_NAME, data)}")
    except Exception:
        traceback.print_exc()
        return 1
    print(f"done in {data['total_seconds']:.0f} s")
    return 0 if all(rec["error"] is None for rec in data["engines"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
