"""The engine is the last word: a student's part, run inside the tiny Qwen3 engine, must give HF transformers'
greedy ids (course machinery).

An exercise that is an engine part (its chapter declares it in the exercise's `parts`, see common.Exercise) is graded in
two steps in one check cell: the chapter's own check, then the part inside the engine.

    with check("E4.3"):
        ch04.check_store_kvcache(store_kvcache)
        in_the_engine("E4.3", store_kvcache=store_kvcache)

`in_the_engine` builds `Parts` with the student's part alone (every other part the reference's, so one broken
exercise fails only itself), runs the engine twice on the tiny random Qwen3 (CPU, fp32, about 0.3 s):

1. four prompts, 8 greedy tokens each, with room to spare: ids must equal HF transformers' `generate`
   (greedy, exactly);
2. the same prompts under a tight KV cache (12 blocks of 4 tokens, 8-token prefill chunks: chunked prefill,
   a prefix-cache hit and preemption by recompute): ids must equal the reference engine's in the same
   setting. Where the part is the sampler, two rows of that batch sample (T > 0, with top-k and top-p) and
   their ids must lie in the vocabulary.

It prints nothing on success (the check's `E4.3 ok` is the verdict) and raises CheckFailed saying which run
differed, for which prompt and at which token, with a hint about what the engine hands this part that a unit
check may not. A part built over several exercises (chapter 07's Scheduler: E7.1-E7.3) runs in the engine
from the check of the last one once every piece is filled in; until then the call prints a note. A part that
only a CUDA graph uses (`graph_batch_sizes`) runs in the engine on a GPU only, with CUDA graphs on, against
the reference engine there; on a CPU the engine captures no graph, so the call does nothing. A Triton kernel
(chapter 06) runs in an engine on the GPU when Triton compiles for one (fp32, the same comparisons), and on the
CPU under Triton's interpreter otherwise.

`your_part_in_the_engine(**functions)` (ungraded, prints one line, never raises) runs all the given parts
together in the first setting: a chapter's demo of its parts in company.
"""
import functools
import warnings

import torch

from nanovllm_course import export
from nanovllm_course.common import CheckFailed, _student_frame, fail

# Prompts of the tiny model's vocabulary (ids < 512): two share a prefix (a prefix-cache hit with block size 4),
# one is long enough to be chunked under the 16-token budget.
PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 40], [5, 9, 11, 3, 7, 2, 8, 40, 41, 42], [100, 4],
           [7, 13, 21, 34, 55, 89, 144, 233, 377, 10, 20, 30, 40, 50, 60, 70, 80, 90]]
MAX_TOKENS = 8
ROOMY = dict(kvcache_block_size=4, max_num_batched_tokens=16, max_model_len=64, enforce_eager=True, device="cpu")
# 12 blocks of 4 for four requests that need 19 at their longest: the scheduler must preempt
TIGHT = dict(kvcache_block_size=4, num_kvcache_blocks=12, max_num_batched_tokens=8, max_model_len=64,
             enforce_eager=True, device="cpu")
MAX_STEPS = 400
GRAPH_ONLY = {"graph_batch_sizes"}        # Parts fields that only CUDA-graph capture calls

# What the engine hands a part that a unit check may not: the hint of a failure inside the engine.
ENGINE_HINTS = {
    "store_kvcache": "in the engine `key` is contiguous (it went through k_norm and RoPE) but `value` is a strided "
                     "view of the fused QKV projection, and padding rows carry slot -1: address each tensor "
                     "with its own strides and skip (or harmlessly write) the -1 slots",
    "attention_backend": "in the engine block tables are padded with -1 past each sequence's blocks, context "
                         "lengths differ per sequence and q is a view of the QKV projection",
    "prepare_prefill": "the engine asks for the slots of a chunk [start, end) that may begin inside a block, "
                       "after a prefix-cache hit or in the middle of a chunked prompt",
    "prepare_decode": "in decode the engine asks for one slot, that of position len(seq) - 1",
    "block_manager": "under a tight cache the engine preempts and re-allocates sequences whose prefix is cached: "
                     "deallocate must leave the sequence as new (no blocks, no hashed blocks)",
    "scheduler": "under a tight cache your scheduler must preempt (newest first), put the victim back at the "
                 "front of the waiting queue and keep chunked prefills going",
    "sampler": "the engine batches greedy and sampled rows together: rows with temperature 0 must stay argmax",
    "qkv_weight_loader": "the engine loads every layer's q, k and v through your loader, one shard id at a time",
    "gate_up_weight_loader": "the engine loads every layer's gate and up projections through your loader",
}


def _chapter(tag: str) -> str:
    return f"{int(tag[1:].split('.')[0]):02d}"


@functools.lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: tuple, max_tokens: int = MAX_TOKENS) -> tuple:
    """HF transformers' greedy continuation of `prompt` (ids) on the checkpoint at `path`; cached per process."""
    from nanovllm_course.ch03 import hf_model
    model = hf_model(path)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return tuple(out[0, len(prompt):].tolist())


def _hf_greedy(path: str, prompt: list[int]) -> list[int]:
    return list(hf_greedy(path, tuple(prompt)))


def run_engine(parts, path: str, prompts, params, **engine_args) -> tuple[list[list[int]], int]:
    """Run the engine step by step on `prompts` (one SamplingParams or one per prompt); stop with RuntimeError
    after MAX_STEPS steps (a part that never lets the engine finish). Returns (ids per prompt, preemptions)."""
    from nanovllm_ref import LLM
    params = params if isinstance(params, list) else [params] * len(prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, parts=parts, **engine_args)
        try:
            ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
            done, steps = {}, 0
            while not llm.is_finished():
                done.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
                steps += 1
                if steps > MAX_STEPS:
                    raise RuntimeError(f"the engine did not finish {len(prompts)} short requests in {MAX_STEPS} steps")
            return [list(done[i]) for i in ids], getattr(llm.scheduler, "num_preemptions", 0)
        finally:
            llm.exit()


def _first_difference(got: list[int], want: list[int]) -> str:
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if k < min(len(got), len(want)):
        return f"new token {k + 1} is {got[k]}, expected {want[k]}"
    return f"{len(got)} new tokens, expected {len(want)}"


def _label(parts_used) -> str:
    names = list(dict.fromkeys(p.name for p in parts_used))
    ranges = sorted({p.exercise for p in parts_used if "-" in p.exercise})
    return " and ".join(names) + (f" ({', '.join(ranges)})" if ranges else "")


def declared_for(tag: str, names) -> list:
    """The parts that exercise `tag` grades inside the engine, checked against the names a check cell passes:
    a name its chapter does not declare for `tag`, or a declared one left out, is a ValueError (an author's
    mistake, raised before anything runs)."""
    exercise = export.declared_exercises().get(_chapter(tag), {}).get(tag)
    parts = list(exercise.parts) if exercise is not None else []
    declared = {p.name for p in parts}
    unknown, missing = sorted(set(names) - declared), sorted(declared - set(names))
    if unknown or missing:
        raise ValueError(f"in_the_engine({tag!r}, ...): chapter {_chapter(tag)} declares {sorted(declared) or 'no part'} "
                         f"for {tag} in its EXERCISES; got {sorted(names)}")
    return parts


def in_the_engine(tag: str, **functions) -> None:
    """Run the student's part(s) for exercise `tag` inside the tiny engine (see the module doc). Raises
    CheckFailed (an AssertionError) when the engine fails or its ids differ; prints nothing on success."""
    from nanovllm_ref import Parts, SamplingParams
    from nanovllm_course.common import tiny_model_dir

    parts_used = declared_for(tag, functions)
    label = _label(parts_used)
    stubs = [name for name, fn in functions.items() if export.is_stub(fn)]
    if stubs:       # a part built over several exercises whose other pieces are still stubs
        print(f"(your {label} runs inside the engine once every exercise it is built from is done)")
        return
    fields = {p.field for p in parts_used}
    parts = Parts(**{p.field: p.value(functions[p.name]) for p in parts_used})
    hint = "; ".join(ENGINE_HINTS[f] for f in sorted(fields) if f in ENGINE_HINTS) or None
    path = tiny_model_dir("qwen3")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if fields <= GRAPH_ONLY:
        if torch.cuda.is_available():
            _graphs_run(tag, label, parts, path, greedy)
        return
    roomy, tight = ROOMY, TIGHT
    if any(p.triton for p in parts_used) and compiled_triton():      # a GPU kernel needs GPU tensors
        roomy, tight = (dict(args, device="cuda", dtype="float32") for args in (ROOMY, TIGHT))

    def run(setting, engine_args, params):
        try:
            return run_engine(parts, path, PROMPTS, params, **engine_args)
        except CheckFailed:
            raise
        except Exception as exc:
            where = _student_frame(exc.__traceback__)
            text = str(exc).strip().splitlines()
            fail(tag, f"inside the tiny engine ({setting}) your {label} raised {type(exc).__name__}: "
                      f"{text[0][:200] if text else ''}" + (f" (in {where[0]}, line {where[1]})" if where else ""),
                 hint)

    got, _ = run("4 prompts, greedy", roomy, greedy)
    want = [_hf_greedy(path, p) for p in PROMPTS]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if bad:
        fail(tag, f"your {label} passes the check above, but inside the tiny engine the greedy ids differ from HF "
                  f"transformers' on {len(bad)} of {len(PROMPTS)} prompts (prompt {bad[0]}: "
                  f"{_first_difference(got[bad[0]], want[bad[0]])})", hint)

    params = [greedy] * len(PROMPTS)
    sampled = []
    if "sampler" in fields:       # greedy and sampled rows in one batch
        sampled = [1, 3]
        params[1] = SamplingParams(temperature=0.8, top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True)
        params[3] = SamplingParams(temperature=1.2, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True)
    setting = "a tight KV cache: 12 blocks of 4 tokens, 8-token chunks, preemption"
    got, _ = run(setting, tight, params)
    want, _ = run_engine(Parts(), path, PROMPTS, params, **tight)
    vocab = _vocab_size(path)
    for i, (g, w) in enumerate(zip(got, want)):
        if i in sampled:
            if len(g) != MAX_TOKENS or not all(0 <= t < vocab for t in g):
                fail(tag, f"inside the tiny engine ({setting}) the sampled request {i} got {len(g)} ids, some outside "
                          f"the vocabulary [0, {vocab})", hint)
        elif g != w:
            fail(tag, f"your {label} passes the check above and the roomy engine run, but under {setting} request "
                      f"{i}'s greedy ids differ from the reference engine's ({_first_difference(g, w)})", hint)


def compiled_triton() -> bool:
    """True when Triton kernels are compiled for a GPU (CUDA, no TRITON_INTERPRET): chapter 06's kernels then
    need the engine on the GPU; in the interpreter they run on CPU tensors."""
    import os
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@functools.lru_cache(maxsize=None)
def _vocab_size(path: str) -> int:
    import json
    from pathlib import Path
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def _graphs_run(tag, label, parts, path, greedy) -> None:
    """CUDA only: the tiny engine with CUDA graphs and `parts` against the reference engine in the same setting."""
    from nanovllm_ref import Parts
    args = dict(ROOMY, device="cuda", enforce_eager=False, max_num_seqs=8)
    try:
        got, _ = run_engine(parts, path, PROMPTS, greedy, **args)
    except Exception as exc:
        fail(tag, f"inside the tiny engine with CUDA graphs your {label} raised {type(exc).__name__}: "
                  f"{(str(exc).strip().splitlines() or [''])[0][:200]}",
             "the engine captures one graph per size your function returns and pads each decode batch up to "
             "the next one: every batch size up to max_num_seqs must find a graph")
    want, _ = run_engine(Parts(), path, PROMPTS, greedy, **args)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if bad:
        fail(tag, f"inside the tiny engine with CUDA graphs your {label} changes the greedy ids of prompt {bad[0]} "
                  f"({_first_difference(got[bad[0]], want[bad[0]])})",
             "a decode batch must replay a graph captured for at least its size")


def your_part_in_the_engine(**functions) -> None:
    """Run the engine with `functions` as parts and print one line: whether every prompt's greedy ids matched HF
    transformers' (ungraded: the exercises' check cells grade each part on its own). Returns None, so a cell that
    ends with this call shows that one line and nothing else (a returned True used to show as a second line)."""
    from nanovllm_course.common import tiny_model_dir

    names = ", ".join(functions)
    stubs = [n for n, fn in functions.items() if export.is_stub(fn)]
    if len(stubs) == len(functions):
        print(f"Your {names}: still {'a stub' if len(stubs) == 1 else 'stubs'}, so the engine would run the "
              "reference. Fill in the exercise, then run this cell again.")
        return None
    parts, used = export.parts_from_functions(**functions)
    path = tiny_model_dir("qwen3")
    from nanovllm_ref import SamplingParams
    try:
        outs, _ = run_engine(parts, path, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                             **ROOMY)
    except Exception as exc:                          # the student's part broke the engine: say how, briefly
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"The engine with your {', '.join(used)} failed: {type(exc).__name__}: {first[:200]}")
        return None
    matched = sum(o == _hf_greedy(path, p) for o, p in zip(outs, PROMPTS))
    skipped = f" ({', '.join(stubs)} still the reference's: stub)" if stubs else ""
    if matched == len(PROMPTS):
        verdict = f"greedy ids equal HF transformers' on all {matched} prompts."
    else:
        verdict = (f"greedy ids match HF transformers' on only {matched}/{len(PROMPTS)} prompts; the exercises' "
                   "check cells say what differs.")
    print(f"Your {', '.join(used)} ran inside the engine{skipped}: {verdict}")
