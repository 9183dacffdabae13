"""What tensor parallelism's communication costs per decode step, alone: two ranks, the collectives of one
TP=2 decode step of the bench model, no model around them.

    python bench/tp_comm.py --out D              # two GPUs: NCCL, eager launches and one CUDA graph per step
    python bench/tp_comm.py --cpu-smoke --out D  # two CPU processes over gloo, small sizes (checks the code path)

One decode step of the Qwen3-0.6B shape (hidden 1024, 28 layers, vocabulary 151,936) at tensor parallel 2 does
(nanovllm_ref/utils/parallel.py, layers/embed_head.py):
- 1 all-reduce of the embedding, [batch, hidden] bf16;
- 2 all-reduces per layer (after attention's o_proj and after the MLP's down_proj), [batch, hidden] bf16;
- 1 gather of the LM head's logits to rank 0, [batch, vocab / 2] bf16 from each rank.

Writes D/tp_comm.json: per batch size, ms per step for the 57 all-reduces (eager, and replayed from one CUDA
graph as the engine's decode graph does) and for the gather, median of 20 timed steps after 5 warm-up steps.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = dict(hidden=1024, layers=28, vocab=151936)
GPU_BATCHES = (1, 64, 256)
SMOKE = dict(hidden=64, layers=2, vocab=512)
SMOKE_BATCHES = (1, 4)


def _time(fn, sync, warmup=5, iters=20) -> float:
    """Median ms of `fn` over `iters` calls, each synchronised, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, cuda: bool, shape: dict, batches, out: str) -> None:
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: dist.barrier())
    dtype = torch.bfloat16
    n_reduce = 1 + 2 * shape["layers"]
    rows = []
    for bs in batches:
        xs = [torch.randn(bs, shape["hidden"], device=device, dtype=dtype) for _ in range(n_reduce)]

        def reduces():
            for x in xs:
                dist.all_reduce(x)

        logits = torch.randn(bs, shape["vocab"] // world, device=device, dtype=dtype)
        parts = [torch.empty_like(logits) for _ in range(world)] if rank == 0 else None

        def gather():
            dist.gather(logits, parts, dst=0)
            if rank == 0:
                torch.cat(parts, dim=-1)

        row = dict(batch=bs, all_reduces_per_step=n_reduce, all_reduce_bytes=bs * shape["hidden"] * 2,
                   gather_bytes_per_rank=logits.numel() * 2,
                   all_reduces_eager_ms=_time(reduces, sync), gather_ms=_time(gather, sync))
        if cuda:
            reduces()                                  # NCCL sets up its buffers outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                reduces()
            row["all_reduces_graph_ms"] = _time(graph.replay, sync)
            del graph
        rows.append(row)
    if rank == 0:
        result = dict(date=time.strftime("%Y-%m-%d"), backend=backend, world_size=world, shape=shape,
                      device=torch.cuda.get_device_name(0) if cuda else "cpu",
                      torch=torch.__version__, rows=rows)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tp_comm.json"), "w") as f:
            json.dump(result, f, indent=2)
        for r in rows:
            extra = f", in a CUDA graph {r['all_reduces_graph_ms']:.3f} ms" if "all_reduces_graph_ms" in r else ""
            print(f"batch {r['batch']:4d}: {r['all_reduces_per_step']} all-reduces {r['all_reduces_eager_ms']:.3f} ms"
                  f" eager{extra}; logits gather {r['gather_ms']:.3f} ms")
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "artifacts/tp_comm"))
    ap.add_argument("--cpu-smoke", action="store_true", help="two gloo ranks on the CPU, small sizes")
    args = ap.parse_args(argv)
    cuda = not args.cpu_smoke
    if cuda and torch.cuda.device_count() < 2:
        print("tp_comm: needs two GPUs (or --cpu-smoke)", file=sys.stderr)
        return 2
    from nanovllm_ref.engine.llm_engine import _free_port         # the engine's own rendezvous-port pick
    port = _free_port()
    shape, batches = (SHAPE, GPU_BATCHES) if cuda else (SMOKE, SMOKE_BATCHES)
    mp.spawn(_rank, args=(2, port, cuda, shape, batches, args.out), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
