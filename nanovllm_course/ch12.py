"""Chapter 12 (capstone): your exercises, exported into importable modules, assembled into one engine.

    capstone = ch12.assemble("../chapters")     # export + Parts + the table of whose part runs
    ch12.tiny_vs_hf(capstone)                   # C.1 greedy ids == HF on the tiny Qwen3
    ch12.stream_vs_reference(capstone)          # C.1 a random stream under a tight block budget == reference
    ch12.tensor_parallel_2(capstone)            # C.1 the same parts with tp=2 over gloo == HF
    ch12.smollm2_vs_reference(capstone)         # C.2 the real model, fp32, up to the first near-tie; both answers
    ch12.smollm2_throughput(capstone)           # C.2 both engines' output tok/s on this CPU (not graded)
    ch12.first_token_chi2(capstone)             # C.3 a chi-squared test of your sampler at T > 0
    with check("E12.1"):
        ch12.check_capstone(your_notebooks, capstone)

What the check decides (E12.1):
- every part that is yours passes its own chapter's check again, run on the exported module (so the part
  that is wrong is named: e.g. `scheduler (ch07 E7.1-E7.3)`);
- every engine comparison above passed; a failing one is traced to a part by running the reference engine
  with one of your parts at a time;
- `E12.1 ok` only when every part is yours; otherwise it prints `still the reference's: ...` and the
  verdict `E12.1 not done yet`.
Tolerances: tiny-model greedy ids exactly equal (HF and the reference); the stream's schedule (running and
waiting queues after every step, preemption count) exactly equal; SmolLM2 fp32 ids (4 chats x 32 tokens, the
reference engine run alongside) equal up to the first step whose reference top-2 logit margin is below 1e-3;
chi-squared p-value above 1e-6 (bins with >= 5 expected; a fixed seed, so the printed p-values repeat).

On a CPU the engine runs chapter 04's PyTorch decode attention where chapter 06's Triton kernel is yours
(the kernel in Triton's interpreter would take minutes per generation); chapter 06's kernel is checked on its
own here and runs inside the engine on a GPU (section C.4).
"""
import contextlib
import dataclasses
import functools
import io
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanovllm_course import export as ex
from nanovllm_course.common import NotDone, CheckFailed, fail, ok, tiny_model_dir

TAG = "E12.1"
REPO = Path(__file__).resolve().parents[1]
STUB_FOLDER = "../chapters"                   # where a student's filled notebooks live, seen from chapters/
SOLUTIONS = str(REPO / "solutions")           # the course's answers (the solution notebook assembles these)
STUDENT = str(REPO / "student")               # where `python -m nanovllm_course export` writes (git-ignored)


# -- each part's own chapter check (run again on the exported module) ---------------------------------------
def _part_checks():
    from nanovllm_course import ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch10
    return {
        ("01", "rms_norm"): lambda mod: ch01.check_rms_norm(mod.rms_norm),
        ("01", "fused_add_rms_norm"): lambda mod: ch01.check_fused_add_rms_norm(mod.fused_add_rms_norm),
        ("02", "rope_cos_sin"): lambda mod: ch02.check_rope_cos_sin(mod.rope_cos_sin),
        ("02", "apply_rope"): lambda mod: ch02.check_apply_rope(mod.apply_rope),
        ("03", "qkv_weight_loader"): lambda mod: ch03.check_packed_loaders(mod.qkv_weight_loader,
                                                                           mod.gate_up_weight_loader),
        ("04", "slot_mapping"): lambda mod: ch04.check_slot_mapping(mod.slot_mapping),
        ("04", "paged_decode"): lambda mod: ch04.check_paged_decode(mod.paged_decode),
        ("04", "store_kvcache"): lambda mod: ch04.check_store_kvcache(mod.store_kvcache),
        ("05", "BlockManager"): lambda mod: ch05.check_block_manager_basics(mod.BlockManager),
        ("05", "CachingBlockManager"): lambda mod: ch05.check_prefix_caching(mod.CachingBlockManager),
        ("06", "store_kvcache"): lambda mod: ch06.check_store_kvcache(mod.store_kvcache),
        ("06", "paged_decode"): lambda mod: ch06.check_paged_decode(mod.paged_decode),
        ("07", "Scheduler"): lambda mod: (ch07.check_schedule_prefill(mod.Scheduler),
                                          ch07.check_schedule_decode(mod.Scheduler),
                                          ch07.check_postprocess(mod.Scheduler)),
        ("08", "sample"): lambda mod: ch08.check_sample(mod.sample),
        # chapter 09's loaders are checked inside the engine with tp=2 (tensor_parallel_2)
        ("10", "graph_batch_sizes"): lambda mod: ch10.check_graph_batch_sizes(mod.graph_batch_sizes),
        ("10", "store_kvcache"): lambda mod: ch10.check_capture_safe_store(mod.store_kvcache),
    }


def part_label(row: dict) -> str:
    """`sampler (ch08 E8.1-E8.4)`: a Parts field and the exercise it comes from."""
    return f"{row['field']} (ch{row['chapter']} {row['exercise']})"


@dataclass
class Capstone:
    folder: str                    # the notebooks the parts were exported from
    rows: list                     # manifest rows (export.parts_from_student), with "source"
    parts: object                  # Parts as exported (chapter 06's kernel where yours)
    cpu_parts: object              # what runs on a CPU: chapter 04's PyTorch decode instead of the Triton kernel
    objects: dict                  # Parts field -> (row, your exported object) for each field that is yours
    results: dict = field(default_factory=dict)     # section -> (passed, part blamed or None, message)
    stub: bool = False             # your_notebooks() was still the stub

    def shown(self) -> dict:
        return ex.shown_rows(self.rows)

    @property
    def cpu_swaps_kernel(self) -> bool:
        """True when the CPU sections (C.1-C.3) run something else in place of your chapter 06 kernel."""
        return self.cpu_parts.attention_backend is not self.parts.attention_backend

    def missing(self) -> list[str]:
        """Labels of the Parts fields an exercise could fill that still run the reference."""
        return [part_label(r) for f, r in self.shown().items() if r["status"] != "done"]

    def plant(self, field_name: str, obj) -> "Capstone":
        """A copy with `obj` as your part for `field_name` (tests: a deliberately wrong part)."""
        row = dict(self.shown()[field_name], status="done", source="yours")
        objects = dict(self.objects, **{field_name: (row, obj)})
        rows = [r for r in self.rows if r["field"] != field_name] + [row]
        parts = dataclasses.replace(self.parts, **{field_name: ex._adapt(field_name, obj, row["name"])})
        cpu = dataclasses.replace(self.cpu_parts, **{field_name: ex._adapt(field_name, obj, row["name"])})
        return Capstone(self.folder, rows, parts, cpu, objects, {}, self.stub)


def _cpu_parts(rows: list, parts):
    """Parts for CPU runs: where the attention back-end is chapter 06's Triton kernel, use chapter 04's
    PyTorch paged_decode if that is done, else the reference's PyTorch back-end."""
    shown = ex.shown_rows(rows)
    row = shown.get("attention_backend")
    if row is None or row["status"] != "done" or row["chapter"] != "06":
        return parts
    import importlib
    ch04 = [r for r in rows if r["field"] == "attention_backend" and r["chapter"] == "04" and r["status"] == "done"]
    if ch04:
        package = Path(_PACKAGE[0]).name
        fn = getattr(importlib.import_module(f"{package}.ch04"), "paged_decode")
        return dataclasses.replace(parts, attention_backend=ex._adapt("attention_backend", fn, "paged_decode"))
    return dataclasses.replace(parts, attention_backend=None)


_PACKAGE = ["student"]


def cpu_rows(cap: Capstone) -> list[dict]:
    """The manifest rows as sections C.1-C.3 run them (always on the CPU): where chapter 06's kernel is yours,
    the attention row names what runs in its place, chapter 04's paged_decode or the reference back-end."""
    if not cap.cpu_swaps_kernel:
        return cap.rows
    rows = [r for r in cap.rows if r["field"] != "attention_backend" or r["chapter"] != "06"]
    if cap.cpu_parts.attention_backend is None:        # chapter 04's decode is still a stub
        kernel = ex.shown_rows(cap.rows)["attention_backend"]
        rows.append(dict(kernel, source="reference", status="ch06 kernel: GPU only"))
    return rows


def cpu_kernel_note(cap: Capstone) -> str | None:
    """One line saying where chapter 06's kernel runs when the table above does not show it."""
    if not cap.cpu_swaps_kernel:
        return None
    row = ex.shown_rows(cap.rows)["attention_backend"]
    return (f"C.1-C.3 run on the CPU, where Triton only interprets: your ch{row['chapter']} {row['exercise']} "
            f"{row['name']} kernel is checked on its own there and runs in the engine in C.4 (GPU)")


def assemble(notebooks_fn=None, out: str = STUDENT) -> Capstone:
    """Export the notebooks named by `notebooks_fn()` (your E12.1; while it is the stub: ../chapters) into the
    importable package `out`, build Parts from it and print which parts are yours."""
    import importlib
    stub = False
    folder = STUB_FOLDER
    if notebooks_fn is not None:
        try:
            folder = str(notebooks_fn())
        except NotImplementedError:
            stub = True
    out_dir = Path(out).resolve()
    _PACKAGE[0] = str(out_dir)
    rows = ex.export(Path(folder), out_dir)
    parts, rows = ex.parts_from_student(out_dir)
    objects = {}
    for f, row in ex.shown_rows(rows).items():
        if row["status"] == "done":
            objects[f] = (row, getattr(importlib.import_module(f"{out_dir.name}.ch{row['chapter']}"), row["name"]))
    cap = Capstone(folder, rows, parts, _cpu_parts(rows, parts), objects, {}, stub)
    print(f"exported {len({r['chapter'] for r in rows})} chapters from {Path(folder).name}/ into {out_dir.name}/")
    print(ex.part_table(cpu_rows(cap)))
    gpu_only = cpu_kernel_note(cap)
    if gpu_only:
        print(gpu_only)
    yours = len(cap.objects)
    print(f"{yours} of {len(cap.shown())} exercise parts are yours")
    if cap.missing():
        print("still the reference's: " + ", ".join(cap.missing()))
    return cap


# -- running engines ----------------------------------------------------------------------------------------
def _quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


TINY = dict(kvcache_block_size=4, max_num_batched_tokens=16, max_model_len=64, enforce_eager=True, device="cpu")
TIGHT = dict(kvcache_block_size=4, num_kvcache_blocks=12, max_num_batched_tokens=8, max_model_len=64,
             enforce_eager=True, device="cpu")


def _record(cap: Capstone, section: str, passed: bool, blamed: str | None, message: str) -> None:
    """Keep a section's outcome for the check (cap.results); sections return None, so a notebook cell shows only
    what they print."""
    cap.results[section] = (passed, blamed, message)


def _generate(parts, path, prompts, sp, **engine_args):
    from nanovllm_ref import LLM
    with _quiet():
        with LLM(path, parts=parts, **engine_args) as llm:
            return [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]


def tiny_vs_hf(cap: Capstone) -> None:
    """C.1: the tiny Qwen3 with your parts, greedy, against HF transformers (exact ids)."""
    from nanovllm_ref import SamplingParams
    from nanovllm_course.engine_check import MAX_TOKENS, PROMPTS, _hf_greedy
    path = tiny_model_dir("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        got = _generate(cap.cpu_parts, path, PROMPTS, sp, **TINY)
    except Exception as exc:
        print(f"C.1 the engine with your parts failed: {_first_line(exc)}")
        return _record(cap, "C.1 HF", False, _blame(cap), _first_line(exc))
    want = [_hf_greedy(path, p) for p in PROMPTS]
    same = sum(g == w for g, w in zip(got, want))
    print(f"C.1 tiny Qwen3, greedy: {same}/{len(PROMPTS)} prompts give exactly HF transformers' ids")
    blamed = None if same == len(PROMPTS) else _blame(cap)
    return _record(cap, "C.1 HF", same == len(PROMPTS), blamed, f"greedy ids differ from HF on {len(PROMPTS) - same} prompt(s)")


def random_stream(g: random.Random, n: int = 6) -> list[list[int]]:
    """n prompts of 6-16 ids below 512; requests 1 and 3 start with the first 8 ids (two blocks of 4) of
    requests 0 and 2 (prefix-cache hits)."""
    prompts = [[g.randrange(1, 512) for _ in range(g.randint(9 if i in (0, 2) else 6, 16))] for i in range(n)]
    for a, b in ((0, 1), (2, 3)):
        prompts[b] = prompts[a][:8] + prompts[b][:max(1, len(prompts[b]) - 8)]
    return prompts


def run_traced(parts, path, prompts, max_tokens=10):
    """Run a stream under TIGHT and record, after every step, the running and waiting queues (as request
    indices) and the preemption count. Returns (ids per request, trace)."""
    from nanovllm_ref import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with _quiet():
        llm = LLM(path, parts=parts, **TIGHT)
        try:
            ids = [llm.add_request(p, sp) for p in prompts]
            index = {sid: i for i, sid in enumerate(ids)}
            done, trace = {}, []
            while not llm.is_finished():
                finished, _ = llm.step()
                done.update(finished)
                s = llm.scheduler
                trace.append(([index[q.seq_id] for q in s.running], [index[q.seq_id] for q in s.waiting],
                              s.num_preemptions))
                if len(trace) > 500:
                    raise RuntimeError("the stream did not finish in 500 steps")
        finally:
            llm.exit()
    return [done[i] for i in ids], trace


def _diff(got, want) -> str | None:
    (gids, gtrace), (wids, wtrace) = got, want
    for k, (g, w) in enumerate(zip(gids, wids)):
        if g != w:
            return f"request {k}'s ids differ from the reference engine's"
    for step, (g, w) in enumerate(zip(gtrace, wtrace)):
        if g != w:
            what = ("preemption count" if g[2] != w[2] else "waiting queue" if g[1] != w[1] else "running batch")
            return (f"after step {step + 1} the {what} differs from the reference engine's: yours running "
                    f"{g[0]}, waiting {g[1]}, {g[2]} preemptions; the reference running {w[0]}, waiting {w[1]}, "
                    f"{w[2]} preemptions (requests by arrival index)")
    if len(gtrace) != len(wtrace):
        return f"the stream took {len(gtrace)} steps, the reference {len(wtrace)}"
    return None


def _blame(cap: Capstone, prompts=None) -> str | None:
    """The first of your parts that, alone in the reference engine, makes the traced stream differ from the
    reference (or breaks the engine)."""
    from nanovllm_ref import Parts
    path = tiny_model_dir("qwen3")
    prompts = prompts or random_stream(random.Random(0))
    want = run_traced(Parts(), path, prompts)
    for f, (row, _) in cap.objects.items():
        one = dataclasses.replace(Parts(), **{f: getattr(cap.cpu_parts, f)})
        if one == Parts():
            continue
        try:
            if _diff(run_traced(one, path, prompts), want) is not None:
                return part_label(row)
        except Exception:
            return part_label(row)
    return None


def stream_vs_reference(cap: Capstone, seed: int | None = None) -> None:
    """C.1: a random stream under a tight block budget (12 blocks of 4: preemption, prefix hits, 8-token
    chunks) through your engine and the reference engine: ids and schedule exactly equal."""
    from nanovllm_ref import Parts
    g = random.Random(seed)
    path = tiny_model_dir("qwen3")
    prompts = random_stream(g)
    want = run_traced(Parts(), path, prompts)
    try:
        got = run_traced(cap.cpu_parts, path, prompts)
        problem = _diff(got, want)
    except Exception as exc:
        problem = f"your engine failed: {_first_line(exc)}"
    pre = want[1][-1][2]
    if problem is None:
        print(f"C.1 random stream ({len(prompts)} requests, 12 blocks of 4, "
              f"{'with' if pre else 'without'} preemption): ids and schedule equal the reference engine's")
        return _record(cap, "C.1 stream", True, None, "")
    print(f"C.1 random stream: {problem}")
    return _record(cap, "C.1 stream", False, _blame(cap, prompts), problem)


def tensor_parallel_2(cap: Capstone) -> None:
    """C.1: your parts in two worker processes (tp=2 over gloo): greedy ids equal HF's."""
    from nanovllm_ref import SamplingParams
    from nanovllm_course.engine_check import MAX_TOKENS, PROMPTS, _hf_greedy
    path = tiny_model_dir("qwen3")
    prompts = PROMPTS[:2]
    try:
        cap.cpu_parts.check_picklable()
        got = _generate(cap.cpu_parts, path, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                     ignore_eos=True),
                        tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64, device="cpu")
    except Exception as exc:
        print(f"C.1 tp=2: the engine failed: {_first_line(exc)}")
        row = ex.shown_rows(cap.rows).get("qkv_weight_loader")
        return _record(cap, "C.1 tp=2", False, part_label(row) if row else None, _first_line(exc))
    same = sum(g == _hf_greedy(path, p) for g, p in zip(got, prompts))
    print(f"C.1 tp=2 over gloo (your parts pickled into 2 workers): {same}/{len(prompts)} prompts equal HF")
    blamed = None
    if same != len(prompts):
        blamed = next((part_label(r) for f, (r, _) in cap.objects.items() if r["chapter"] == "09"), None)
    return _record(cap, "C.1 tp=2", same == len(prompts), blamed, f"tp=2 ids differ from HF on {len(prompts) - same} prompt(s)")


# -- C.2 the real model ---------------------------------------------------------------------------------------
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours.",
         "How many legs does a spider have?"]
SMOL_TOKENS = 32
MARGIN = 1e-3


SMOL_ARGS = dict(dtype="float32", device="cpu", max_model_len=128, enforce_eager=True, kvcache_block_size=16,
                 num_kvcache_blocks=24)


@functools.lru_cache(maxsize=None)
def _tokenizer(path: str):
    """SmolLM2's tokenizer, loaded once per folder (C.2 templates the prompts and decodes both answers)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def smollm2_prompts(path: str) -> list[list[int]]:
    """The four CHATS as token ids, through SmolLM2's chat template (which adds its default system prompt)."""
    tok = _tokenizer(path)
    out = []
    for c in CHATS:
        ids = tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return out


class _MarginRecorder:
    """Reference parts that also keep, for every request, the top-2 logit margin of each step's logits.

    The engine calls prepare_prefill / prepare_decode with the step's sequences and then the sampler with one
    logits row per sequence, in that order; so the prepare wrappers note whose rows the next sampler call gets.
    Only for tp=1 (the bound methods do not pickle into workers)."""

    def __init__(self):
        from nanovllm_ref import Parts
        self.ref = Parts()
        self.rows: list[int] = []                  # seq ids of the step being run
        self.margins: dict[int, list[float]] = {}  # seq id -> margin at each sampled token

    def prepare_prefill(self, seqs, block_size, device):
        self.rows = [s.seq_id for s in seqs]
        return self.ref.prepare_prefill(seqs, block_size, device)

    def prepare_decode(self, seqs, block_size, device):
        self.rows = [s.seq_id for s in seqs]
        return self.ref.prepare_decode(seqs, block_size, device)

    def sampler(self, logits, metadata):
        top2 = logits.float().topk(2, dim=-1).values
        for sid, m in zip(self.rows, (top2[:, 0] - top2[:, 1]).tolist()):
            self.margins.setdefault(sid, []).append(m)
        return self.ref.sampler(logits, metadata)

    def parts(self):
        import dataclasses as dc
        return dc.replace(self.ref, prepare_prefill=self.prepare_prefill, prepare_decode=self.prepare_decode,
                          sampler=self.sampler)


def reference_smollm2(max_tokens: int = SMOL_TOKENS, path: str | None = None) -> list[tuple[list[int], list[float]]]:
    """Per chat prompt: the reference engine's greedy ids and, at each of those steps, the top-2 margin of the
    logits the reference engine itself sampled from (fp32, CPU). About 2 s for 4 x 32 tokens."""
    from nanovllm_ref import SamplingParams
    from nanovllm_models.download import ensure_model
    path = path or str(ensure_model())
    prompts = smollm2_prompts(path)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rec = _MarginRecorder()
    got = _generate(rec.parts(), path, prompts, sp, **SMOL_ARGS)
    out = []
    for ids, sid in zip(got, sorted(rec.margins)[-len(prompts):]):    # sequence ids rise in prompt order
        margins = rec.margins[sid]
        # every prompt is prefilled in one chunk here, so each sampler row produced one kept token
        assert len(margins) == len(ids) == max_tokens, (len(margins), len(ids))
        out.append((ids, margins))
    return out


def _fmt_margin(m: float) -> str:
    """Two significant digits: enough to set a margin beside MARGIN, and few enough that the last digit does not
    move with another CPU's summation order (fp32 logits of ~20 carry ~1e-5 of noise)."""
    return f"{m:.2g}"


def smollm2_vs_reference(cap: Capstone, max_tokens: int = SMOL_TOKENS) -> None:
    """C.2: SmolLM2-135M-Instruct fp32, 4 chat prompts x max_tokens: your engine's greedy ids against the
    reference engine's (run here, live), compared up to the first step whose reference top-2 logit margin is
    below MARGIN; there the float order of two engines may legitimately pick the other token."""
    from nanovllm_ref import SamplingParams
    from nanovllm_models.download import ensure_model
    path = str(ensure_model())
    prompts = smollm2_prompts(path)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reference = reference_smollm2(max_tokens, path)
    try:
        got = _generate(cap.cpu_parts, path, prompts, sp, **SMOL_ARGS)
    except Exception as exc:
        print(f"C.2 SmolLM2 with your parts failed: {_first_line(exc)}")
        return _record(cap, "C.2 SmolLM2", False, None, _first_line(exc))
    tok = _tokenizer(path)
    passed = True
    for k, (g, (w, margins)) in enumerate(zip(got, reference)):
        stop = next((s for s, m in enumerate(margins) if m < MARGIN), len(w))
        first_diff = next((s for s, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
        if first_diff < stop:
            passed = False
            print(f"C.2 prompt {k}: {first_diff}/{len(w)} ids equal, then step {first_diff + 1} differs from the "
                  f"reference (reference top-2 margin there {_fmt_margin(margins[first_diff])}, not a near-tie)")
        elif stop < len(w):
            print(f"C.2 prompt {k}: {stop}/{len(w)} ids equal; step {stop + 1}'s top-2 margin "
                  f"({_fmt_margin(margins[stop])}) is below {MARGIN:g}, so the comparison stops there")
        else:
            low = min(range(len(margins)), key=margins.__getitem__)
            print(f"C.2 prompt {k}: {len(w)}/{len(w)} ids equal the reference engine's (smallest top-2 margin "
                  f"{_fmt_margin(margins[low])}, at step {low + 1})")
        print(f"    {CHATS[k]}\n    yours:     {_answer(tok, g)}\n    reference: {_answer(tok, w)}")
    return _record(cap, "C.2 SmolLM2", passed, None if passed else _blame(cap),
                   "SmolLM2 ids differ from the reference engine's before any near-tie")


def _answer(tok, ids: list[int]) -> str:
    """The reply `ids` spell, up to the model's end-of-turn id (C.2 runs with ignore_eos, so the ids go on
    past it), on one line."""
    cut = next((i for i, t in enumerate(ids) if t == tok.eos_token_id), len(ids))
    return " / ".join(line for line in tok.decode(ids[:cut], skip_special_tokens=True).strip().splitlines() if line)


def smollm2_throughput(cap: Capstone, max_tokens: int = SMOL_TOKENS, repeats: int = 3) -> None:
    """C.2's four prompts on this CPU, greedy, max_tokens each with ignore_eos: output tokens per second of your
    engine and of the reference engine, each the median of `repeats` generate calls in one engine after one
    warm-up call. Information, not graded: the numbers vary with the machine and its load."""
    import statistics
    import time
    from nanovllm_ref import LLM, Parts, SamplingParams
    from nanovllm_models.download import ensure_model
    path = str(ensure_model())
    prompts = smollm2_prompts(path)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rates = {}
    for who, parts in (("yours", cap.cpu_parts), ("reference", Parts())):
        try:
            with _quiet(), LLM(path, parts=parts, **SMOL_ARGS) as llm:
                llm.generate(prompts, sp, use_tqdm=False)
                runs = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    llm.generate(prompts, sp, use_tqdm=False)
                    runs.append(len(prompts) * max_tokens / (time.perf_counter() - t))
            rates[who] = statistics.median(runs)
        except Exception as exc:
            print(f"C.2 throughput, {who}: failed: {_first_line(exc)}")
    if len(rates) == 2:
        print(f"C.2 on this CPU ({len(prompts)} prompts x {max_tokens} tokens, median of {repeats}): yours "
              f"{rates['yours']:,.0f} output tok/s, reference {rates['reference']:,.0f} "
              f"({rates['yours'] / rates['reference']:.2f}x)")


# -- C.3 sampling ---------------------------------------------------------------------------------------------
def _fmt_p(p: float) -> str:
    """The p-value as the notebook prints it: two decimals, or a bound below 0.01 (the digits of a tiny p-value
    depend on every draw)."""
    return f"p = {p:.2f}" if p >= 0.01 else ("p < 0.01" if p > CHI2_P else f"p < {CHI2_P:g}")


CHI2_P = 1e-6          # a correct sampler falls below this once in a million runs
CHI2_SEED = 0


def first_token_chi2(cap: Capstone, temperatures=(0.6, 1.5), draws: int = 20000, seed: int = CHI2_SEED) -> None:
    """C.3: your sampler (as it runs in the engine) on the first-step logits of the tiny model, `draws` times
    per temperature; frequencies against the reference probabilities softmax(logits / T). The global torch
    generator is seeded with `seed` inside a fork (the caller's random state is left as it was), so the
    p-values printed are the same on every run."""
    from nanovllm_ref.layers.sampler import SamplingMetadata
    from nanovllm_course.ch03 import hf_model
    from nanovllm_course.ch08 import chi_square_test
    from nanovllm_course.engine_check import PROMPTS
    path = tiny_model_dir("qwen3")
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    sampler = cap.cpu_parts.sampler
    passed, batch = True, 2000
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for t in temperatures:
            counts = torch.zeros(logits.numel(), dtype=torch.long)
            try:
                for _ in range(draws // batch):
                    meta = SamplingMetadata(temperatures=torch.full((batch,), t), all_greedy=False)
                    ids = sampler(logits.expand(batch, -1).clone(), meta)
                    counts += torch.bincount(ids.long().flatten(), minlength=logits.numel())
            except Exception as exc:
                print(f"C.3 T={t}: the sampler failed: {_first_line(exc)}")
                return _record(cap, "C.3 sampling", False, _sampler_label(cap), _first_line(exc))
            p, bins = chi_square_test(counts, torch.softmax(logits / t, dim=-1))
            verdict = "consistent with" if p > CHI2_P else "NOT consistent with"
            print(f"C.3 T={t}: {draws} first tokens, chi-squared over {bins} bins, {_fmt_p(p)}: {verdict} "
                  "softmax(logits / T)")
            passed &= p > CHI2_P
    return _record(cap, "C.3 sampling", passed, None if passed else _sampler_label(cap),
                   "first-token frequencies do not follow softmax(logits / T)")


def _sampler_label(cap: Capstone) -> str:
    return part_label(ex.shown_rows(cap.rows)["sampler"])


# -- E12.1 -------------------------------------------------------------------------------------------------
def check_parts(cap: Capstone) -> None:
    """Every part of yours passes its own chapter's check again (output hidden); fail naming the first that
    does not."""
    checks = _part_checks()
    done = set()
    todo = list(cap.objects.items())
    if cap.cpu_swaps_kernel and cap.cpu_parts.attention_backend:
        # on a CPU chapter 04's paged_decode runs in place of chapter 06's kernel: check it too
        row04 = next(r for r in cap.rows if r["field"] == "attention_backend" and r["chapter"] == "04")
        todo.append(("attention_backend", (row04, cap.cpu_parts.attention_backend.paged_decode)))
    for f, (row, obj) in todo:
        key = (row["chapter"], row["name"])
        if key not in checks or key in done:
            continue
        done.add(key)
        mod = _PlantedModule(row, obj)
        try:
            with contextlib.redirect_stdout(io.StringIO()), _quiet():
                checks[key](mod)
        except CheckFailed as exc:
            fail(TAG, f"your {part_label(row)} fails its chapter's check: {exc.message.splitlines()[0]}",
                 f"open chapter {row['chapter']}, fix {row['name']} until its check says ok, then run this "
                 "notebook again (it exports your chapters afresh)")
        except Exception as exc:
            fail(TAG, f"your {part_label(row)} raised {_first_line(exc)} in its chapter's check",
                 f"open chapter {row['chapter']} and run its check cell")


class _PlantedModule:
    """The exported module of a row, with `obj` in place of the row's name (a planted part in tests)."""

    def __init__(self, row, obj):
        import importlib
        self._mod = importlib.import_module(f"{Path(_PACKAGE[0]).name}.ch{row['chapter']}")
        self._name, self._obj = row["name"], obj

    def __getattr__(self, name):
        return self._obj if name == self._name else getattr(self._mod, name)


def check_capstone(notebooks_fn, cap: Capstone) -> None:
    """E12.1: your parts pass their chapters' checks, the engine sections passed, and every part is yours."""
    try:
        folder = str(notebooks_fn())
    except NotImplementedError:
        folder = None
    check_parts(cap)
    for section, (passed, blamed, message) in cap.results.items():
        if not passed:
            fail(TAG, f"{section}: {message}" + (f"; the part that does it: {blamed}" if blamed else ""),
                 f"run {blamed.split(' ')[0] if blamed else 'each part'}'s chapter check again" if blamed else
                 "run the section's cell again and read what it printed")
    missing = cap.missing()
    if folder is None or missing:
        if missing:
            print("still the reference's: " + ", ".join(missing))
        raise NotDone(TAG, "not implemented yet (" + ("your_notebooks() is still the stub" if folder is None
                                                      else f"{len(missing)} part(s) are the reference's") + ")")
    ok(TAG)
