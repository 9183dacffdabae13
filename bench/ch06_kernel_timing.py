"""Time a chapter-06 paged-decode kernel against the engine's split-KV decode on a GPU; write JSON.

    python bench/ch06_kernel_timing.py bench/results/ch06_kernels_h200.json
    python bench/ch06_kernel_timing.py out.json --notebook chapters/06_triton_kernels.ipynb   # a student's
    python bench/ch06_kernel_timing.py out.json --kernel student.ch06:paged_decode            # an export

The kernel under test has the signature paged_decode(q, k_cache, v_cache, block_tables, context_lens,
scale). By default it is the `paged_decode` of solutions/06_triton_kernels.ipynb (the E6.3 solution: one
program per sequence and KV head), read from the notebook with the standard library only. It is timed with
triton.testing.do_bench against `nanovllm_ref.kernels.attention.paged_decode` (split-KV + merge, the
engine's heuristic) and the same kernel forced to one split, on one layer of Qwen3-0.6B: 16 query heads,
8 KV heads, head_dim 128, bf16, blocks of 256 tokens, every sequence `context` tokens long. Each output is
first compared with the engine's (max abs error reported). `figures_ch06.py` draws the JSON.
"""
import argparse
import ast
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))                   # nanovllm_ref from this checkout
SHAPE = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=256, dtype=torch.bfloat16)


def load_from_notebook(path: Path, name: str = "paged_decode"):
    """`name` from a notebook: its top-level imports (those that import here) plus the top-level functions,
    classes and assignments of the last code cell that defines `name` (json + ast only, no Jupyter)."""
    cells = [c["source"] if isinstance(c["source"], str) else "".join(c["source"])
             for c in json.loads(Path(path).read_text())["cells"] if c["cell_type"] == "code"]
    trees = []
    for src in cells:
        try:
            trees.append(ast.parse(src))
        except SyntaxError:
            trees.append(None)
    ns = {"__name__": f"ch06_from_{Path(path).stem}"}
    for src, tree in zip(cells, trees):
        for node in tree.body if tree else []:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    exec(compile(ast.Module([node], []), str(path), "exec"), ns)
                except ImportError:
                    pass                          # e.g. notebook-only helpers; the kernel cell needs none
    owner = None
    for src, tree in zip(cells, trees):
        if tree and any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name for n in tree.body):
            owner = (src, tree)
    if owner is None:
        raise SystemExit(f"{path} defines no top-level {name}")
    src, tree = owner
    body = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign))]
    # Triton reads a kernel's source with inspect: give the cell a real file so getsource works.
    cell_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"ch06_cell_{os.getpid()}.py"
    cell_file.write_text(src)
    exec(compile(ast.Module(body, []), str(cell_file), "exec"), ns)
    return ns[name]


def load_kernel(spec: str):
    module, _, fn = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), fn)


def make_inputs(batch: int, context: int, seed: int = 0):
    """Random q and caches with every sequence `context` tokens long, blocks in random order."""
    s = SHAPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-context // s["block_size"])
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, s["block_size"], s["num_kv_heads"], s["head_dim"])
    k_cache = torch.randn(shape, generator=g, device="cuda", dtype=s["dtype"])
    v_cache = torch.randn(shape, generator=g, device="cuda", dtype=s["dtype"])
    tables = torch.randperm(num_blocks, generator=g, device="cuda").view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, s["num_heads"], s["head_dim"], generator=g, device="cuda", dtype=s["dtype"])
    return q, k_cache, v_cache, tables, lens


def run(kernel, batches=(1, 4, 16, 64, 256), contexts=(1024, 8192)) -> list[dict]:
    """Rows {batch, context, student_us, reference_us, reference_1split_us, max_abs_err, kv_bytes, ...}."""
    import triton.testing
    from nanovllm_ref.kernels.attention import paged_decode as engine_decode
    scale = SHAPE["head_dim"] ** -0.5
    rows = []
    for context in contexts:
        for batch in batches:
            args = make_inputs(batch, context)
            expected = engine_decode(*args, scale)
            err = (kernel(*args, scale).float() - expected.float()).abs().max().item()
            student = triton.testing.do_bench(lambda: kernel(*args, scale), warmup=25, rep=100)
            ref = triton.testing.do_bench(lambda: engine_decode(*args, scale), warmup=25, rep=100)
            one = triton.testing.do_bench(lambda: engine_decode(*args, scale, num_splits=1), warmup=25, rep=100)
            kv_bytes = 2 * batch * context * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * args[1].element_size()
            rows.append(dict(batch=batch, context=context, student_us=student * 1e3, reference_us=ref * 1e3,
                             reference_1split_us=one * 1e3, max_abs_err=err, kv_bytes=kv_bytes,
                             student_tb_s=kv_bytes / (student * 1e-3) / 1e12,
                             reference_tb_s=kv_bytes / (ref * 1e-3) / 1e12))
            del args, expected
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--notebook", default=str(REPO / "solutions" / "06_triton_kernels.ipynb"))
    src.add_argument("--kernel", help="module:function to import instead of a notebook")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the figure figures/ch06_decode_timing_h200.png was measured on an H200)")
        return 1
    os.environ.pop("TRITON_INTERPRET", None)       # compiled kernels, whatever the shell says
    kernel = load_kernel(args.kernel) if args.kernel else load_from_notebook(Path(args.notebook))
    import triton
    rows = run(kernel, args.batches, args.contexts)
    data = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__,
                python=platform.python_version(), kernel=args.kernel or Path(args.notebook).name,
                shape={k: str(v) for k, v in SHAPE.items()}, rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    for r in rows:
        print(f"batch {r['batch']:>4} context {r['context']:>6}: kernel {r['student_us']:9.1f} us "
              f"({r['student_tb_s']:.2f} TB/s), engine {r['reference_us']:9.1f} us ({r['reference_tb_s']:.2f} TB/s), "
              f"engine 1 split {r['reference_1split_us']:9.1f} us, max |err| {r['max_abs_err']:.2e}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
