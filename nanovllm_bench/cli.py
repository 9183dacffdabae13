"""Throughput benchmark: `python -m nanovllm_bench` (also `python -m nanovllm_ref bench`), chapter 11.

Default workload = upstream nano-vllm's bench.py (nanovllm_bench/workload.py): a Qwen3-0.6B-shaped model with
random weights, 256 requests, 142,827 prompt and 133,966 output tokens, ignore_eos, temperature 0.6, one
warm-up generate first. Throughput = output tokens / wall seconds of the timed generate.

Peers, each in its own process on the same workload (nanovllm_bench/harness.py; a peer that cannot run gets
a row with the reason, and the others still run):
- nanovllm_ref with each requested back-end, CUDA graphs and eager (`--runs triton:graph,flash_attn:graph`);
- vLLM, when importable; upstream nano-vllm, when importable or given `--nanovllm-src DIR`;
- HF transformers continuous batching (`--hf-repeats`: one run takes about 180 s on an H200).
Every row: the median of `--repeats` timed runs with min and max, none finding anything cached from an
earlier one; batch-1 decode tok/s (one 100-token prompt, 1,024 new tokens); start-up seconds; versions;
% of the physical floor (nanovllm_bench/floor.py, from the copy bandwidth and matmul rate measured here).

`serve ...` runs the online serving benchmark instead (nanovllm_bench/serve.py: an OpenAI-compatible server
under Poisson arrivals; `serve --help`).

`--cpu` runs the CPU benchmark on the real model instead (SmolLM2-135M against HF `generate`, one process;
nanovllm_bench/cpu.py). `--cpu-tiny` runs this harness on a tiny random model with 16 short requests.
Results: <out>/bench_<tag>.json and .csv; `--figures DIR` draws them (nanovllm_bench/figures.py).
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile
import warnings

CPU_WORKLOADS = ("chat8", "chat32_eos")
RUN_BACKENDS = ("triton", "flash_attn", "torch", "cpu")


def _int_at_least(low: int):
    """An argparse type: a whole number >= low, else an error that says so and quotes the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {value}")
        return value
    return parse


_positive_int, _count = _int_at_least(1), _int_at_least(0)


def _choices_list(allowed):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{', '.join(bad) or repr(text)}: choose from {', '.join(allowed)} "
                                             "(comma-separated)")
        return items
    return parse


def _threads(text: str) -> list[int]:
    try:
        return [_positive_int(t) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected thread counts >= 1, comma-separated (e.g. 2,1), got {text!r}") \
            from None


def _runs(text: str) -> list[tuple[str, bool, tuple[str, ...]]]:
    from nanovllm_bench.harness import RUN_OPTIONS
    out = []
    for item in text.split(","):
        backend, mode, *options = item.strip().split(":")
        if backend not in RUN_BACKENDS or mode not in ("graph", "eager") or \
                any(o not in RUN_OPTIONS for o in options):
            raise argparse.ArgumentTypeError(f"{item!r}: each run is BACKEND:MODE[:OPTION...] with BACKEND one of "
                                             f"{', '.join(RUN_BACKENDS)}, MODE graph or eager, OPTION one of "
                                             f"{', '.join(RUN_OPTIONS)} (sync: async_scheduling off; nokernels: "
                                             "decode_kernels off; persistent: decode_kernels persistent)")
        out.append((backend, mode == "eager", tuple(options)))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nanovllm_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true",
                      help="CPU run on the real model: SmolLM2-135M fp32 against HF generate (nanovllm_bench/cpu.py)")
    mode.add_argument("--cpu-tiny", action="store_true", help="tiny CPU run: tiny random model, 16 short requests")
    ap.add_argument("--peers", type=_choices_list(("nanovllm_ref", "vllm", "nano-vllm", "hf")),
                    default=["nanovllm_ref", "vllm", "nano-vllm", "hf"],
                    help="comma list of peers: nanovllm_ref, vllm, nano-vllm, hf (default: all)")
    ap.add_argument("--warm-start", type=_choices_list(("nanovllm_ref", "vllm", "nano-vllm", "hf")), default=[],
                    help="comma list of peers whose start-up runs once, untimed, in a process of its own before the "
                         "measured one, so that it finds its compile caches filled as on a machine that ran it "
                         "before (vLLM 0.20 on the H200: 94-108 s cold, 46 s warm)")
    ap.add_argument("--runs", type=_runs, default=None,
                    help="nanovllm_ref's rows, e.g. triton:graph,flash_attn:graph,triton:eager,triton:graph:sync "
                         "(options: sync = async_scheduling off, nokernels = decode_kernels off, persistent = "
                         "decode_kernels persistent; overrides --backends/--no-eager)")
    ap.add_argument("--backends", default="auto",
                    help="comma list of nanovllm_ref back-ends, or 'auto' (GPU: triton, and flash_attn where a "
                         "FlashAttention is on the path; CPU: cpu)")
    ap.add_argument("--no-eager", action="store_true", help="skip nanovllm_ref's eager (no CUDA graph) rows")
    ap.add_argument("--no-hf", action="store_true", help="leave out the HF transformers peer")
    ap.add_argument("--nanovllm-src", default=None, help="folder holding upstream nano-vllm's `nanovllm` package")
    ap.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per row (median, min and max)")
    ap.add_argument("--hf-repeats", type=_positive_int, default=1, help="timed runs of the HF peer (~180 s each on "
                                                                      "an H200)")
    ap.add_argument("--batch1-repeats", type=_count, default=3, help="batch-1 runs per row (median); 0 = none")
    ap.add_argument("--peer-timeout-s", type=_positive_int, default=600, help="limit for one peer's process")
    ap.add_argument("--deadline-s", type=_positive_int, default=None,
                    help="limit for all peers together; a peer not started in time gets a row saying so")
    ap.add_argument("--logs", default=None, help="folder for each peer's log (default: a temporary folder)")
    ap.add_argument("--merge", default=None, help="add this call's rows to an earlier record JSON (same workload)")
    ap.add_argument("--profile", action="store_true",
                    help="also time every step of the workload and count kernels per decode step (CUDA)")
    ap.add_argument("--graph-sweep", action="store_true", help="also measure CUDA-graph speedup per batch size")
    ap.add_argument("--num-requests", type=_positive_int, default=None, help="default: 256 (GPU), 16 (--cpu-tiny)")
    ap.add_argument("--max-num-seqs", type=_positive_int, default=None, help="nanovllm_ref's; default 512 (GPU), 16 "
                                                                           "(--cpu-tiny), the engine's (--cpu)")
    ap.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                    help="nanovllm_ref's; default 16384 (GPU), 1024 (--cpu-tiny), the engine's (--cpu)")
    ap.add_argument("--kvcache-block-size", type=_positive_int, default=None,
                    help="nanovllm_ref's; default 256 (GPU), 16 (--cpu-tiny), the engine's (--cpu)")
    ap.add_argument("--tensor-parallel-size", type=_positive_int, default=1, help="GPUs (or CPU ranks) per engine")
    ap.add_argument("--out", default="bench/results", help="folder for JSON/CSV (CPU runs are git-ignored there)")
    ap.add_argument("--figures", default=None, help="folder for PNG figures (default: none)")
    ap.add_argument("--tag", default=None)
    cpu = ap.add_argument_group("--cpu only")
    cpu.add_argument("--threads", type=_threads, default=[1, 2], help="torch thread counts to measure, e.g. 2,1")
    cpu.add_argument("--workloads", type=_choices_list(CPU_WORKLOADS), default=list(CPU_WORKLOADS),
                     help=f"comma list of {', '.join(CPU_WORKLOADS)}")
    cpu.add_argument("--budget-s", type=float, default=150,
                     help="stop repeating a cell after this many seconds (busy machine); 0 = never")
    cpu.add_argument("--max-tokens-eos", type=_positive_int, default=96, help="max tokens of the eos-on workload")
    cpu.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    return ap


def _default_backends(cuda: bool) -> list[str]:
    if not cuda:
        return ["cpu"]
    # Whether a FlashAttention is on the path, without importing it here (vLLM's import patches torch).
    found = any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "vllm"))
    return ["triton"] + (["flash_attn"] if found else [])


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:                         # the online benchmark has its own commands
        from nanovllm_bench import serve
        return serve.main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cpu:
        from nanovllm_bench import cpu
        return cpu.main(args)
    import torch

    from nanovllm_bench import harness
    from nanovllm_bench.floor import model_stats, physical_floor
    from nanovllm_bench.machine import (device_name, host_probe, measure_machine, project_commit, source_digest,
                                        versions)
    from nanovllm_bench.workload import EXPECTED_TOTALS, cpu_tiny_workload, gpu_workload, make_model_folder
    cuda = torch.cuda.is_available() and not args.cpu_tiny
    device = "cuda" if cuda else "cpu"
    if cuda:
        workload = gpu_workload(args.num_requests or 256)
        engine_args = dict(max_model_len=4096, max_num_seqs=args.max_num_seqs or 512,
                           max_num_batched_tokens=args.max_num_batched_tokens or 16384,
                           kvcache_block_size=args.kvcache_block_size or 256,
                           tensor_parallel_size=args.tensor_parallel_size)
    else:
        workload = cpu_tiny_workload(args.num_requests or 16)
        engine_args = dict(max_model_len=256, max_num_seqs=args.max_num_seqs or 16,
                           max_num_batched_tokens=args.max_num_batched_tokens or 1024,
                           kvcache_block_size=args.kvcache_block_size or 16, device="cpu",
                           tensor_parallel_size=args.tensor_parallel_size)
    prompts, max_tokens = workload.draw()
    totals = (sum(map(len, prompts)), sum(max_tokens))
    if cuda and workload.num_requests in EXPECTED_TOTALS and EXPECTED_TOTALS[workload.num_requests] != totals:
        print(f"workload totals {totals} differ from upstream's {EXPECTED_TOTALS[workload.num_requests]}",
              file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="nanovllm_bench_")
    path = make_model_folder(workload.model, os.path.join(tmp, "model"))
    print(f"workload: {harness.workload_name(workload)}: {totals[0]:,} prompt tokens, {totals[1]:,} output tokens")

    from transformers import AutoConfig
    machine = measure_machine(device)
    machine.update(device=device, device_name=device_name(device), commit=project_commit(), sources=source_digest(),
                   **versions(), host_probe=host_probe())
    floor = physical_floor(prompts, max_tokens, model_stats(AutoConfig.from_pretrained(path)),
                           machine["copy_bandwidth_Bps"], machine["matmul_flops"])
    floor["floor_tok_s"] = totals[1] / floor["floor_s"]
    print(f"machine: {machine['device_name']}, copy {machine['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, matmul "
          f"{machine['matmul_flops'] / 1e12:.1f} TFLOP/s; floor {floor['floor_s']:.2f} s = {floor['floor_tok_s']:,.0f} tok/s")

    backends = _default_backends(cuda) if args.backends == "auto" else args.backends.split(",")
    runs = args.runs or [(b, e) for b in backends for e in ([False, True] if cuda and not args.no_eager else
                                                            [not cuda])]
    peers = [p for p in args.peers if not (p == "hf" and args.no_hf)]
    try:
        specs = harness.plan_peers(peers, runs, engine_args, cuda=cuda, repeats=args.repeats,
                                   hf_repeats=args.hf_repeats, batch1_repeats=args.batch1_repeats,
                                   nanovllm_src=args.nanovllm_src, warm_start=args.warm_start)
    except ValueError as exc:                        # --warm-start names a peer this call leaves out
        print(f"--{exc}".replace("--warm_start", "--warm-start", 1), file=sys.stderr)
        return 2
    rows = harness.run_all(specs, workload, path, cuda=cuda, log_dir=args.logs or os.path.join(tmp, "logs"),
                           peer_timeout_s=args.peer_timeout_s, deadline_s=args.deadline_s, floor_s=floor["floor_s"])
    tag = args.tag or ("h200" if cuda and "H200" in machine["device_name"] else device)
    record = harness.make_record(tag, machine, workload, totals, floor, rows, engine_args, peers_requested=peers,
                                 harness=dict(peer_timeout_s=args.peer_timeout_s, deadline_s=args.deadline_s))
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        if (earlier["workload"]["output_tokens"], earlier["workload"]["prompt_tokens"]) != (totals[1], totals[0]):
            print("--merge: the earlier record has another workload", file=sys.stderr)
            return 2
        names = {r["name"] for r in rows}
        for r in rows:
            r["note"] = f"measured in a separate call on {record['date']}, same machine kind"
            if r.get("seconds"):
                r["pct_of_floor"] = 100 * earlier["floor"]["floor_s"] / r.get("floor_gpus", 1) / r["seconds"]
        earlier["runs"] = [r for r in earlier["runs"] if r["name"] not in names] + rows
        # The merged record keeps the earlier call's machine and protocol; this call's go beside them.
        earlier.setdefault("merged_calls", []).append(dict(date=record["date"], time_utc=record["time_utc"],
                                                           machine=record["machine"], protocol=record["protocol"],
                                                           rows=sorted(names)))
        record = earlier
    harness.save_record(record, args.out)
    ref_backend = next((r[0] for r in runs if not r[1]), runs[0][0] if runs else "triton")
    if args.profile and cuda:
        from nanovllm_bench.profile import step_profile
        record["step_profile"] = step_profile(path, dict(engine_args, attention_backend=ref_backend), prompts,
                                              max_tokens)
        print("step profile:", json.dumps(record["step_profile"]["workload"]))
        for size, e in record["step_profile"]["decode_steps"].items():
            # the round-3 targets: kernels a layer, and host time the device waits for
            print(f"decode {size}: step {e['graph_step_ms']:.3f} ms"
                  + (f", {e['kernels_per_layer']:.1f} kernels a layer" if "kernels_per_layer" in e else "")
                  + (f", device {e['gpu_step_ms']:.3f} ms, host not overlapped {e['host_not_overlapped_ms']:.3f} ms"
                     if "gpu_step_ms" in e else ""))
    if args.graph_sweep and cuda:
        if args.tensor_parallel_size > 1:
            print("--graph-sweep measures one process; skipped with --tensor-parallel-size > 1")
        else:
            from nanovllm_bench.profile import graph_sweep
            record["graph_sweep"] = graph_sweep(path, dict(engine_args, attention_backend=ref_backend))
            for r in record["graph_sweep"]:
                print(f"decode bs {r['batch_size']:4d}: eager {r['eager_ms']:7.2f} ms, graph {r['graph_ms']:7.2f} ms, "
                      f"{r['speedup']:.1f}x")
    stem = harness.save_record(record, args.out)
    print(f"wrote {stem}.json and .csv")
    if args.figures:
        from nanovllm_bench.figures import draw_figures
        for p in draw_figures(record, args.figures):
            print(f"wrote {p}")
    return 0 if any(r.get("status") == "ok" for r in rows) else 1     # a peer that cannot run is no error


if __name__ == "__main__":
    sys.exit(main())
