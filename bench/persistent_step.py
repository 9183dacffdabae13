#!/usr/bin/env python3
"""Issue 29, round 6: the persistent batch-1 decode step (kernels/persistent_decode.py) against the layers.

    python3 bench/persistent_step.py --out step.json             # the GPU run, ~1-2 min
    python3 bench/persistent_step.py --dry-run --out /tmp/s.json  # CPU: Triton interpreter, tiny shapes, 2 layers

A Qwen3-0.6B-shaped model (28 layers, random weights, bf16) with the engine's decode kernels (FusedKernels.all,
PDL where the GPU has it) runs one decode step of one sequence at several context lengths, in CUDA-graph
replays, two ways: its layers (9 kernels a layer) and the persistent kernel (one launch). Per context: the
step's time each way, the largest difference of the final hidden state and of the KV rows the step wrote, and
the barrier give-ups counted by the kernel (0 unless programs could not all be resident). Variants of the
persistent launch (warps) are timed too. The LM head and sampler are not part of either (the engine runs them
after the forward in both cases).
"""
import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--contexts", default="128,612,1124,2048")
    p.add_argument("--warps", default="8,4")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--programs", type=int, default=None, help="programs of the persistent grid (default one an SM)")
    p.add_argument("--first-warps", type=int, default=None, help="warps of the step's first (checked) call")
    p.add_argument("--variants", default="",
                   help='JSON list of PersistentConfig overrides to time (fused and, with --breakdown, by phase), '
                        'e.g. \'[{"bn_qkv": 32}, {"num_splits": 8}]\'')
    p.add_argument("--breakdown", action="store_true",
                   help="also time each phase alone: its 28 launches as separate kernels (no barriers)")
    p.add_argument("--timestamps", action="store_true",
                   help="GPU: also each phase's time inside the fused launch (the clock at each step's start)")
    p.add_argument("--compile-check", action="store_true",
                   help="CPU or GPU: only compile the kernel for sm_90 (bf16, Qwen3-0.6B); record its registers, "
                        "spills, shared memory and global loads by width")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import kernels_round3 as r3  # noqa: E402  (bypasses nanovllm_ref/__init__, which imports the engine)
import torch  # noqa: E402


def compile_check(out: str) -> int:
    """Compile the persistent kernel for sm_90 as the engine launches it for Qwen3-0.6B in bf16 on 132 SMs
    (no GPU needed: Triton's own ptxas), and print its registers, spills and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from nanovllm_ref.kernels import persistent_decode as pd
    s = r3.QWEN3
    cfg = pd.choose_config(s["hidden"], s["inter"], s["heads"], s["kv_heads"], s["head_dim"], 132, gpu=True)
    bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
    sig = dict(base_ptr=bf, table_ptr=i64, embed_ptr=bf, final_norm_ptr=bf, ids_ptr=i64, out_ptr=bf,
               k_cache_ptr=bf, v_cache_ptr=bf, layer_stride_kv="i64", positions_ptr=i64, slot_ptr=i32,
               block_table_ptr=i32, context_lens_ptr=i32, cos_sin_ptr=f32, stride_cs="i32", resid_ptr=bf,
               qkv_ptr=bf, part_out=f32, part_lse=f32, count_ptr=i32, attn_ptr=bf, o_part=f32,
               act_ptr=bf, d_part=f32, bar_ptr=i32, exit_ptr=i32, err_ptr=i32, ts_ptr=i64, eps="fp32", qk_scale="fp32",
               num_splits="i32", step_lo="i32", step_hi="i32")
    consts = dict(NUM_LAYERS=28, HIDDEN=s["hidden"], INTER=s["inter"], NUM_HEADS=s["heads"],
                  NUM_KV_HEADS=s["kv_heads"], HEAD_DIM=s["head_dim"], BLOCK_H=triton.next_power_of_2(s["hidden"]),
                  BLOCK_D=s["head_dim"], BLOCK_G=16, BLOCK_N=cfg.block_n,
                  BLOCK_S=triton.next_power_of_2(cfg.num_splits), BLOCK_SIZE=256, TILE_IN_BLOCK=True,
                  BN_QKV=cfg.bn_qkv, BN_O=cfg.bn_o, KC_O=cfg.kc_o, BN_GU=cfg.bn_gate_up, BN_DOWN=cfg.bn_down,
                  KC_DOWN=cfg.kc_down, PHASES=pd.PHASES, QK_NORM=True, STEPWISE=False, PREFETCH=cfg.prefetch, HOIST=cfg.hoist,
                  TIMESTAMPS=False, ALIGNED=True, KV_ALIGNED=True, CAST_FP32=False,
                  EMULATE=False, DOT_PRECISION="tf32")
    full = {**sig, **{k: "constexpr" for k in consts}}
    # As a launch specialises them: every pointer (torch allocations are 16-byte aligned) and stride_cs (a
    # multiple of 16) divisible by 16; layer_stride_kv and the step bounds are do_not_specialize.
    names = pd._persistent_decode_kernel.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*") or k == "stride_cs"}
    rec = {"config": dataclasses.asdict(cfg), "triton": triton.__version__, "builds": []}
    for warps in (4, 8):
        compiled = triton.compile(ASTSource(pd._persistent_decode_kernel, full, consts, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        row = {"num_warps": warps, **r3.resource_usage(compiled.asm.get("cubin", b"")),
               "dynamic_shared": compiled.metadata.shared,
               "global_loads_by_bits": load_widths(compiled.asm["ptx"])}
        rec["builds"].append(row)
        print("compiled", rec["config"], row, flush=True)
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


def load_widths(ptx: str) -> dict:
    """Global load instructions in `ptx` by bits a thread loads per instruction (e.g. {16: 40, 128: 12}): 16-bit
    loads of bf16 weights mean the compiler could not prove their alignment (one element a load, not eight)."""
    import re
    counts = {}
    for vec, bits in re.findall(r"ld\.global(?:\.[a-z0-9:]+)*?(?:\.v(\d))?\.[bu](\d+)\b", ptx):
        width = int(vec or 1) * int(bits)
        counts[width] = counts.get(width, 0) + 1
    return dict(sorted(counts.items()))


PHASE_NAMES = ["norm+qkv", "attention", "o_proj", "norm+gate_up", "down"]   # persistent_decode's P0-P4


def phase_times(step_obj, inputs, layers: int, runs: int = 5) -> dict:
    """Inside one fused launch, from the clock program 0 writes as each step starts (PersistentConfig.timestamps):
    the mean time of each phase over layers 1.. (a phase = its work and the barrier after it), the median over
    `runs` launches, and the whole launch from its first step to program 0's end."""
    import statistics
    from nanovllm_ref.kernels import persistent_decode
    base = step_obj.config
    step_obj.config = dataclasses.replace(base, timestamps=True)
    names = PHASE_NAMES
    per_run = []
    try:
        for _ in range(runs):
            with torch.inference_mode():
                step_obj(*inputs)
            ts = step_obj.timestamps.cpu().tolist()
            steps = layers * persistent_decode.PHASES + 1
            d = [(ts[s + 1] - ts[s]) / 1000 for s in range(steps)]
            rec = {f"stamped_{n}_us": statistics.mean(d[layer * 5 + i] for layer in range(1, layers))
                   for i, n in enumerate(names)}
            rec["stamped_total_us"] = (ts[steps] - ts[0]) / 1000
            per_run.append(rec)
    finally:
        step_obj.config = base
    return {k: round(statistics.median(r[k] for r in per_run), 2) for k in per_run[0]}


def main(args) -> int:
    if args.compile_check:
        return compile_check(args.out)
    from nanovllm_ref.kernels import persistent_decode
    from nanovllm_ref.layers.attention import Attention
    from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata
    from nanovllm_ref.utils.fusion import FusedKernels
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry or args.dtype == "fp32" else torch.bfloat16
    s, layers = (r3.TINY, 2) if dry else (r3.QWEN3, 28)
    pdl = False
    if not dry:
        from nanovllm_ref.kernels.numerics import pdl_available
        pdl = pdl_available(device)
    kernels = FusedKernels.all(pdl=pdl, persistent=True)
    model = r3.build_layers(s, layers, kernels, device, dtype, fuse=not dry)
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    block_size = 16 if dry else 256
    contexts = [int(c) for c in args.contexts.split(",")] if not dry else [5, 37]
    max_ctx = max(contexts) + 1
    per_seq = -(-max_ctx // block_size)
    num_blocks = per_seq + 3
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(2, layers, num_blocks, block_size, s["kv_heads"], s["head_dim"], device=device,
                        generator=g).to(dtype)
    for i, a in enumerate(attn):
        a.k_cache, a.v_cache = cache[0, i], cache[1, i]
    # A scattered block table (blocks in reverse order), as an engine's would be.
    table = torch.full((1, per_seq + 1), -1, dtype=torch.int32, device=device)
    table[0, :per_seq] = torch.arange(per_seq, 0, -1, dtype=torch.int32, device=device)
    rec = {"device": "cpu" if dry else torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": r3.triton.__version__, "layers": layers, "dtype": str(dtype), "pdl": pdl, "cases": []}
    step_obj = model.model.persistent_step(programs=args.programs)
    if args.first_warps:
        step_obj.config = dataclasses.replace(step_obj.config, num_warps=args.first_warps)
    rec["config"] = dataclasses.asdict(step_obj.config)
    print("config", rec["config"], flush=True)
    for ctx in contexts:
        pos = ctx                                            # the new token sits at position ctx (context ctx + 1)
        slot = int(table[0, pos // block_size]) * block_size + pos % block_size
        meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([slot], dtype=torch.int32, device=device),
                                 context_lens=torch.tensor([ctx + 1], dtype=torch.int32, device=device),
                                 block_tables=table)
        ids = torch.tensor([7], device=device)
        positions = torch.tensor([pos], device=device)

        def run(persistent: bool):
            model.model.persistent = persistent
            with attention_metadata(meta), torch.inference_mode():
                return model(ids, positions)
        ref = run(False).float()
        ref_k, ref_v = cache[0, :, slot // block_size, slot % block_size].clone(), \
            cache[1, :, slot // block_size, slot % block_size].clone()
        cache[:, :, slot // block_size, slot % block_size] = 0
        got = run(True).float()
        row = {"context": ctx + 1,
               "hidden_max_abs_diff": float((got - ref).abs().max()),
               "hidden_rel_norm_diff": float((got - ref).norm() / ref.norm()),
               "k_rows_max_abs_diff": float((cache[0, :, slot // block_size, slot % block_size] - ref_k).abs().max()),
               "v_rows_max_abs_diff": float((cache[1, :, slot // block_size, slot % block_size] - ref_v).abs().max())}
        if not dry:
            row["barrier_give_ups_first_call"] = int(step_obj.errors.item())
        if not dry and row["barrier_give_ups_first_call"] == 0 and row["hidden_rel_norm_diff"] < 0.05:
            row["layers_us"] = round(r3.time_us([lambda: run(False)], device, reps=10, iters=9)[0], 2)
            base = step_obj.config
            for warps in [int(w) for w in args.warps.split(",")]:
                for prefetch in (False, True):
                    step_obj.config = dataclasses.replace(base, num_warps=warps, prefetch=prefetch)
                    key = f"persistent_w{warps}{'_prefetch' if prefetch else ''}_us"
                    try:
                        row[key] = round(r3.time_us([lambda: run(True)], device, reps=10, iters=9)[0], 2)
                    except Exception as exc:                     # a launch shape that does not fit: recorded
                        row[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
            step_obj.config = base
        variants = [{}] + (json.loads(args.variants) if args.variants else [])
        if not dry and (args.breakdown or args.variants) and row.get("layers_us"):
            inputs = (ids, positions, meta.slot_mapping, meta.block_tables, meta.context_lens)
            steps = layers * persistent_decode.PHASES + 1
            names = PHASE_NAMES
            base = step_obj.config
            for overrides in variants:
                step_obj.config = dataclasses.replace(base, **overrides)
                tag = "".join(f"_{k}{v}" for k, v in overrides.items())
                try:
                    with torch.inference_mode():
                        got_v = step_obj(*inputs).float()
                        row[f"rel_diff{tag}"] = float((got_v - ref).norm() / ref.norm())
                        row[f"fused{tag}_us"] = round(r3.time_us(
                            [lambda: step_obj.run_steps([(0, steps)], False, *inputs)], device, reps=5, iters=7)[0], 2)
                        for phase, name in enumerate(names if args.breakdown else []):
                            first = [layer * persistent_decode.PHASES + phase for layer in range(layers)]
                            spans = [(f, f + 1) for f in first]
                            row[f"alone_{name}{tag}_us_per_layer"] = round(r3.time_us(
                                [lambda: step_obj.run_steps(spans, True, *inputs)], device, reps=5, iters=7)[0] / layers, 2)
                except Exception as exc:
                    row[f"fused{tag}_us"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print({k: v for k, v in row.items() if tag and tag in k}, flush=True)
            step_obj.config = base
        if not dry and args.timestamps and row.get("layers_us"):
            row.update(phase_times(step_obj, (ids, positions, meta.slot_mapping, meta.block_tables, meta.context_lens),
                                   layers))
            print({k: v for k, v in row.items() if k.startswith("stamped")}, flush=True)
        if not dry:
            row["barrier_give_ups"] = int(step_obj.errors.item())
        rec["cases"].append(row)
        print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
