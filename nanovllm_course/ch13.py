"""Chapter 13 (capstone): your exercises, exported into importable modules, assembled into one engine.

    capstone = ch13.assemble(".", choose_parts)  # export + each part's own check + your E13.1 choice + the table
    ch13.tiny_vs_hf(capstone)                   # C.1 greedy ids == HF on the tiny Qwen3
    ch13.stream_vs_reference(capstone)          # C.1 a random stream under a tight block budget == reference
    ch13.tensor_parallel_2(capstone)            # C.1 the same parts with tp=2 over gloo == HF
    ch13.smollm2_vs_reference(capstone)         # C.2 the real model, fp32, up to the first near-tie; both answers
    ch13.smollm2_throughput(capstone)           # C.2 both engines' output tok/s on this CPU (not graded)
    ch13.first_token_chi2(capstone)             # C.3 a chi-squared test of your sampler at T > 0
    with check("E13.1"):
        ch13.check_capstone(choose_parts, capstone)

E13.1, `choose_parts(candidates, cuda) -> {Parts field: Candidate}`: the student decides which of their
exported parts runs. `assemble` exports the chapter notebooks of a folder into a fresh package (each call its
own: `export.fresh_package_dir`, so two students, or two graders at once, never share one), runs each finished
part's own chapter check again on the exported module (the check each chapter declares in `PARTS`), and
describes every declared part as a `Candidate` whose status is "ok" (its check passed here), "failed",
"stub" or "missing". The rules (the reference is `reference_choose_parts`):
- only a candidate with status "ok" runs;
- on a machine without CUDA a Triton candidate (chapter 06) does not run: Triton only interprets it there, far
  too slowly for an engine (C.2 would take minutes), so the next candidate runs in its place;
- among the candidates left for a field, the highest `rank` (chapter, exercise) wins: chapter 10's store over
  06's over 04's, E5.3's caching block manager over E5.2's;
- a field with no candidate left is not in the result (the engine keeps the reference's part).
`assemble` runs the student's choice (cuda=False for C.1-C.3, the machine's for C.4) when it follows the rules
on the student's own candidates, and otherwise the reference's, saying why on the line "which parts run: the
course's, because ..." (a stub, an error, a choice that cannot run, or one that could run but breaks a rule,
such as a wrong ranking); the printed table names, for each field, whose part runs and, for each better-ranked
candidate that does not, why not.

What the check decides (E13.1): `choose_parts` equals the reference on fresh random candidate lists (statuses,
Triton kernels, ties within a chapter, cuda on and off; the message says which rule a difference breaks), the
capstone above was assembled with it, and the engine it assembled passed sections C.1-C.3 (a failing section is
traced to a part by running the reference engine with one of the student's parts at a time). Parts still
missing are listed, not held against E13.1: each chapter grades its own.
Tolerances: tiny-model greedy ids exactly equal (HF and the reference); the stream's schedule (running and
waiting queues after every step, preemption count) exactly equal; SmolLM2 fp32 ids (4 chats x 32 tokens, the
reference engine run alongside) equal up to the first step whose reference top-2 logit margin is below 1e-3;
chi-squared p-value above 1e-6 (bins with >= 5 expected; a fixed seed, so the printed p-values repeat).
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
from nanovllm_course.common import CheckFailed, call_student, check_type, fail, fresh_generator, ok, \
    tiny_model_dir

TAG = "E13.1"
REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = str(REPO / "solutions")           # the course's answers (tests assemble these)
STATUSES = ("ok", "failed", "stub", "missing")


# -- E13.1: which part runs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One exported exercise part that could fill a Parts field."""
    field: str            # the nanovllm_ref.Parts field it would fill: "store_kvcache"
    exercise: str         # where it comes from: "E10.3", or "E7.1-E7.3" for a part built over three exercises
    name: str             # the notebook's function or class: "store_kvcache"
    status: str           # "ok" (passed its chapter's check here), "failed", "stub" or "missing"
    triton: bool          # a Triton kernel (chapter 06): on a machine without CUDA only interpreted
    rank: tuple           # (chapter, exercise number): the higher rank is the later part, (10, 3) > (6, 1)

    @property
    def chapter(self) -> str:
        return f"{self.rank[0]:02d}"

    @property
    def label(self) -> str:
        """`ch10 E10.3 store_kvcache`."""
        return f"ch{self.chapter} {self.exercise} {self.name}"


def candidate_of(part, status: str) -> Candidate:
    """The Candidate of a declared part (common.EnginePart) with the given status."""
    last = part.graded_by                         # "E7.3" for "E7.1-E7.3"
    return Candidate(part.field, part.exercise, part.name, status, part.triton,
                     (int(last[1:].split(".")[0]), int(last.split(".")[1])))


def reference_choose_parts(candidates, cuda: bool) -> dict:
    """The answer to E13.1: {Parts field: the Candidate that runs}, by the rules in the module doc."""
    chosen = {}
    for c in candidates:
        if c.status != "ok" or (c.triton and not cuda):
            continue
        if c.field not in chosen or c.rank > chosen[c.field].rank:
            chosen[c.field] = c
    return chosen


def _clean_choice(choice) -> dict:
    """A choice without the fields mapped to None (the spec lets either mean "the reference's")."""
    return {k: v for k, v in choice.items() if v is not None}


def _candidate_sets(g: torch.Generator):
    """(name, candidates, cuda) cases: every declared part with random statuses, shuffled, cuda on and off; and
    the fixed cases a rule hides in (the capstone's issue: chapter 10's store a stub, 06's a Triton kernel on a
    CPU, 04's ok)."""
    parts = ex.all_parts()
    rng = random.Random(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))

    def of(statuses):
        return [candidate_of(p, statuses.get((p.chapter, p.name), "ok")) for p in parts]

    cases = [("every part ok, no CUDA", of({}), False), ("every part ok, CUDA", of({}), True),
             ("every part a stub", of({(p.chapter, p.name): "stub" for p in parts}), False),
             ("no candidate at all", [], True),
             ("E10.3 a stub, E6.1 and E4.3 ok, no CUDA", of({("10", "store_kvcache"): "stub"}), False),
             ("E10.3 a stub, E6.1 and E4.3 ok, CUDA", of({("10", "store_kvcache"): "stub"}), True),
             ("E5.3 failed its check, E5.2 ok", of({("05", "CachingBlockManager"): "failed"}), False),
             ("E6.3 ok, E4.2 missing, no CUDA", of({("04", "paged_decode"): "missing"}), False)]
    for k in range(24):
        statuses = {(p.chapter, p.name): rng.choice(STATUSES[:1] * 3 + STATUSES[1:]) for p in parts}
        cands = of(statuses)
        rng.shuffle(cands)
        cases.append((f"random statuses, shuffled (case {k + 1})", cands, bool(k % 2)))
    return cases


def _last_runnable_seen(cands: list, cuda: bool) -> dict:
    """{field: the last candidate in list order that may run}: what a chooser that ignores rank returns."""
    return {c.field: c for c in cands if c.status == "ok" and not (c.triton and not cuda)}


def _choice_problem(got: dict, want: dict, cands: list, cuda: bool):
    """(message, hint) for the first field where `got` differs from `want`, or None."""
    fields = [f.name for f in dataclasses.fields(__import__("nanovllm_ref").Parts)]
    keys = [f for f in fields if f in got or f in want] + sorted(k for k in got if k not in fields)
    device = "with CUDA" if cuda else "without CUDA"
    for f, g in got.items():
        if not any(g is c for c in cands):
            return (f"the value for {f!r} is not one of the candidates you were given (got {type(g).__name__})",
                    "map each field to the Candidate object itself, e.g. chosen[c.field] = c")
        if g.field != f:
            return (f"you put {g.label} (a {g.field} part) under {f!r}",
                    "key the dict by each candidate's field: chosen[c.field] = c")
    # A choice that skipped every Triton kernel can also be, by chance on a shuffled list, the last runnable one
    # seen in list order; only the first reading gets the Triton hint (a fn that never picks Triton fails on the
    # unshuffled "every part ok, CUDA" case first, where the last one seen is the right one).
    if (cuda and got != want and got == reference_choose_parts([c for c in cands if not c.triton], cuda)
            and got != _last_runnable_seen(cands, cuda)):
        f = next(f for f in keys if got.get(f) is not want.get(f))
        return (f"{f}: {device} you chose {got[f].label if f in got else 'the reference'}, the right one is the "
                f"Triton kernel {want[f].label}", "skip Triton candidates only when cuda is False: on a GPU they run")
    for f in keys:
        g, w = got.get(f), want.get(f)
        if g is w:
            continue
        if g is not None and g.status != "ok":
            return (f"{f}: you chose {g.label}, whose status is {g.status!r}",
                    "only a candidate with status 'ok' (it passed its chapter's check) may run; a stub, a missing "
                    "part or one that failed its check falls back to the next candidate")
        if g is not None and g.triton and not cuda:
            return (f"{f}: {device} you chose the Triton kernel {g.label}",
                    "without CUDA a Triton kernel only runs in Triton's interpreter, far too slowly: skip Triton "
                    "candidates when cuda is False")
        if g is None:
            if w.triton:
                return (f"{f}: {device} you left it to the reference, but the Triton kernel {w.label} may run",
                        "skip Triton candidates only when cuda is False: on a GPU they run")
            better = [c for c in cands if c.field == f and c.rank > w.rank]
            return (f"{f}: you left it to the reference, but {w.label} is ok and may run",
                    "when the best-ranked candidate cannot run, fall back to the next one, not straight to the "
                    "reference" if better else "every field that has a candidate with status 'ok' gets one")
        if w is None:       # g is ok, no Triton on a CPU: only a field the reference leaves empty gets here
            return (f"{f}: you chose {g.label}, but no candidate may run there", None)
        same_chapter = g.rank[0] == w.rank[0]
        return (f"{f}: {device} you chose {g.label}, the right one is {w.label}",
                f"within one chapter the later exercise wins ({w.exercise} over {g.exercise}): compare c.rank, "
                "whatever order the candidates come in"
                if same_chapter else
                f"the highest chapter wins (chapter {w.chapter} over chapter {g.chapter}): compare c.rank, "
                "whatever order the candidates come in")
    return None


def check_choose_parts(fn) -> None:
    """E13.1's own check (the first half of check_capstone): fn against reference_choose_parts on fresh cases."""
    g = fresh_generator()
    for name, cands, cuda in _candidate_sets(g):
        given = list(cands)
        got = call_student(TAG, fn, cands, cuda)
        check_type(TAG, got, dict, f"choose_parts(...) ({name})", "return a dict {field: Candidate}")
        if len(cands) != len(given) or any(a is not b for a, b in zip(cands, given)):
            fail(TAG, f"choose_parts changed the list it was given ({name}): sorted or removed items in place",
                 "work on a copy (sorted(candidates, ...)) or just loop over it")
        problem = _choice_problem(_clean_choice(got), reference_choose_parts(cands, cuda), cands, cuda)
        if problem:
            fail(TAG, f"{problem[0]} (case: {name})", problem[1])


# -- assembling ------------------------------------------------------------------------------------------------
def part_label(c: Candidate) -> str:
    """`sampler (ch08 E8.1-E8.4)`: a Parts field and the exercise its Candidate comes from."""
    return f"{c.field} (ch{c.chapter} {c.exercise})"


@dataclass
class Capstone:
    folder: str                    # the notebooks the parts were exported from
    package: str                   # the exported package's import name (student_<hex>, in a temp folder)
    candidates: list               # [Candidate], every declared part, in the chapters' order
    problems: dict                 # (chapter, exercise) -> why its check failed (status "failed")
    objects: dict                  # (chapter, name) -> the exported object, for every part that is ok
    chooser: str                   # "yours", or "the course's, because <why>" (E13.1 a stub, a rule broken, ...)
    choice: dict                   # {field: Candidate}: what C.1-C.3 run (always on the CPU)
    gpu_choice: dict               # {field: Candidate}: what C.4 runs (this machine with CUDA, if it has one)
    cpu_parts: object = None       # nanovllm_ref.Parts built from `choice`
    gpu_parts: object = None       # and from `gpu_choice`
    results: dict = field(default_factory=dict)     # section -> (passed, part blamed or None, message)

    def cpu_objects(self) -> dict:
        """Parts field -> (Candidate, your exported object) for each field C.1-C.3 run your code in."""
        return {f: (c, self.objects[(c.chapter, c.name)]) for f, c in self.choice.items()}

    def yours(self) -> list:
        """Exercise labels whose parts are all ok, in order."""
        return [e for e, cs in _by_exercise(self.candidates).items() if all(c.status == "ok" for c in cs)]

    def missing(self) -> list:
        """Labels (`sampler (ch08 E8.1-E8.4)`) of the exercise parts that are not yours and ok."""
        return [part_label(cs[0]) for e, cs in _by_exercise(self.candidates).items()
                if any(c.status != "ok" for c in cs)]

    def plant(self, field_name: str, obj) -> "Capstone":
        """A copy whose C.1-C.3 run `obj` as your part for `field_name`, as if your chosen candidate there were
        it (tests: a wrong part that passed its own check)."""
        c = self.choice[field_name]
        objects = {**self.objects, (c.chapter, c.name): obj}
        part = ex.part_for(c.chapter, c.name, field_name)
        cpu = dataclasses.replace(self.cpu_parts, **{field_name: part.value(obj)})
        return dataclasses.replace(self, objects=objects, cpu_parts=cpu, results={})


def _by_exercise(candidates) -> dict:
    out = {}
    for c in candidates:
        out.setdefault((c.chapter, c.exercise), []).append(c)
    return {f"ch{k[0]} {k[1]}": v for k, v in out.items()}


def _quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def run_part_check(part, module) -> str | None:
    """Run `part`'s declared chapter check on `module` with its output hidden: None when it passes, else the
    first line of why not."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), _quiet():
            part.check(module)
    except CheckFailed as exc:
        return exc.message.splitlines()[0] if exc.message else "failed"
    except Exception as exc:
        return f"raised {_first_line(exc)}"
    return None


def statuses(rows: list, package: str) -> tuple[list, dict, dict]:
    """From export manifest rows: ([Candidate], {(chapter, exercise): why it failed}, {(chapter, name): obj}).
    Each exercise whose rows are all done has its chapter's check run once on the exported module."""
    import importlib
    by_key = {(r["chapter"], r["name"], r["field"]): r for r in rows}
    done_ex = {}
    for part in ex.all_parts():
        row = by_key.get((part.chapter, part.name, part.field))
        done_ex.setdefault((part.chapter, part.exercise), []).append(row is not None and row["status"] == "done")
    problems, objects, checked = {}, {}, set()
    for part in ex.all_parts():
        key = (part.chapter, part.exercise)
        if not all(done_ex[key]) or key in checked:
            continue
        checked.add(key)
        module = importlib.import_module(f"{package}.ch{part.chapter}")
        why = run_part_check(part, module) if part.check is not None else None
        if why is not None:
            problems[key] = why
    candidates = []
    for part in ex.all_parts():
        row = by_key.get((part.chapter, part.name, part.field))
        key = (part.chapter, part.exercise)
        if row is None or row["status"] == "missing":
            status = "missing"
        elif not all(done_ex[key]):            # this part, or another of its exercise, still a stub
            status = "stub"
        else:
            status = "failed" if key in problems else "ok"
        candidates.append(candidate_of(part, status))
        if status == "ok":
            module = importlib.import_module(f"{package}.ch{part.chapter}")
            objects[(part.chapter, part.name)] = getattr(module, part.name)
    return candidates, problems, objects


def _valid_choice(choice, candidates, cuda: bool) -> str | None:
    """Why `choice` (a student's) cannot be run as it is, or None."""
    if not isinstance(choice, dict):
        return f"it returned a {type(choice).__name__}, not a dict"
    for f, c in _clean_choice(choice).items():
        if not any(c is k for k in candidates):
            return f"the value for {f!r} is not one of the candidates"
        if c.field != f:
            return f"it put {c.label} under {f!r}"
        if c.status != "ok":
            return f"it chose {c.label}, whose status is {c.status!r}"
        if c.triton and not cuda:
            return f"it chose the Triton kernel {c.label} for a run without CUDA"
    return None


def parts_of(choice: dict, objects: dict):
    """nanovllm_ref.Parts with each chosen Candidate's exported object (adapted) in its field."""
    from nanovllm_ref import Parts
    return Parts(**{f: ex.part_for(c.chapter, c.name, f).value(objects[(c.chapter, c.name)])
                    for f, c in choice.items()})


def _choose(choose_parts, candidates, cuda: bool) -> tuple[dict, str]:
    """(choice, who chose): the student's choice when it is done and follows rules 1-4 on these candidates, else
    the course's (reference_choose_parts) with why, in the words the table prints after "which parts run: "."""
    course = reference_choose_parts(candidates, cuda)
    if choose_parts is None:
        return course, "the course's"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            choice = choose_parts(list(candidates), cuda)
    except NotImplementedError:
        return course, "the course's, because E13.1 is still a stub"
    except Exception as exc:
        return course, f"the course's, because your choose_parts raised {_first_line(exc)}"
    why = _valid_choice(choice, candidates, cuda)
    if why:
        return course, f"the course's, because your choose_parts cannot run as it is ({why})"
    problem = _choice_problem(_clean_choice(choice), course, candidates, cuda)
    if problem:                       # it could run, but it is not what rules 1-4 choose: the course's runs
        return course, f"the course's, because your choose_parts breaks a rule here ({problem[0]})"
    return _clean_choice(choice), "yours"


def _why_not(c: Candidate, cap_problems: dict, cuda: bool) -> str:
    if c.status == "stub":
        return "still a stub"
    if c.status == "missing":
        return "not in the notebooks" 
    if c.status == "failed":
        return f"fails its chapter's check ({cap_problems.get((c.chapter, c.exercise), '')})"
    if c.triton and not cuda:
        return "a Triton kernel: C.1-C.3 run on the CPU, where Triton only interprets; it runs on a GPU (C.4)"
    return "not chosen"


def part_table(cap: Capstone) -> str:
    """One line per Parts field: whose part C.1-C.3 run and from which exercise; under it, each better-ranked
    candidate that does not run and why (what fell back to what)."""
    from nanovllm_ref import Parts
    lines = [f"{'part':<22} {'runs':<10} from"]
    by_field = {}
    for c in cap.candidates:
        by_field.setdefault(c.field, []).append(c)
    for f in (f.name for f in dataclasses.fields(Parts)):
        chosen = cap.choice.get(f)
        offered = sorted(by_field.get(f, []), key=lambda c: c.rank, reverse=True)
        if not offered:
            lines.append(f"{f:<22} {'reference':<10} (no exercise)")
            continue
        lines.append(f"{f:<22} {'yours':<10} {chosen.label}" if chosen else f"{f:<22} {'reference':<10}")
        for c in offered:
            if chosen is not None and c.rank <= chosen.rank:
                break
            lines.append(f"{'':<22} {'':<10} not {c.label}: {_why_not(c, cap.problems, False)}")
    return "\n".join(lines)


def assemble(folder: str = ".", choose_parts=None) -> Capstone:
    """Export the chapter notebooks in `folder` (relative to the notebook: "." is the notebook's own folder)
    into a fresh package, check each finished part, let `choose_parts` (your E13.1; the course's while it is
    the stub) choose what runs, build the Parts and print the table: whose part runs, and what fell back to
    what."""
    import importlib
    out_dir = ex.fresh_package_dir()
    rows = ex.export(Path(folder), out_dir)
    package = ex.import_package(out_dir).__name__
    candidates, problems, objects = statuses(rows, package)
    choice, chooser = _choose(choose_parts, candidates, cuda=False)
    cuda = torch.cuda.is_available()
    gpu_choice = _choose(choose_parts, candidates, cuda=cuda)[0] if cuda else choice
    cap = Capstone(str(folder), package, candidates, problems, objects, chooser, choice, gpu_choice)
    cap.cpu_parts = parts_of(choice, objects)
    cap.gpu_parts = parts_of(gpu_choice, objects) if cuda else cap.cpu_parts
    importlib.invalidate_caches()
    print(f"exported {len({r['chapter'] for r in rows})} chapter notebooks from {Path(folder).resolve().name}/ "
          f"{ex.SAVED_NOTE}")
    print(f"which parts run: {chooser}")
    print(part_table(cap))
    print(f"{len(cap.yours())} of {len(_by_exercise(candidates))} exercises have parts that are yours and pass "
          f"their chapter's check; C.1-C.3 run your code in {len(choice)} of {len(dataclasses.fields(cap.cpu_parts))} "
          "Parts fields")
    if cap.missing():
        print("still the reference's: " + ", ".join(cap.missing()))
    return cap


# -- running engines ----------------------------------------------------------------------------------------


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
            index = {rid: i for i, rid in enumerate(ids)}
            done, trace = {}, []
            while not llm.is_finished():
                done.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
                s = llm.scheduler
                trace.append(([index[q.request_id] for q in s.running], [index[q.request_id] for q in s.waiting],
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
    for f, (cand, _) in cap.cpu_objects().items():
        one = dataclasses.replace(Parts(), **{f: getattr(cap.cpu_parts, f)})
        if one == Parts():
            continue
        try:
            if _diff(run_traced(one, path, prompts), want) is not None:
                return part_label(cand)
        except Exception:
            return part_label(cand)
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
        cand = cap.choice.get("qkv_weight_loader")
        return _record(cap, "C.1 tp=2", False, part_label(cand) if cand else None, _first_line(exc))
    same = sum(g == _hf_greedy(path, p) for g, p in zip(got, prompts))
    print(f"C.1 tp=2 over gloo (your parts pickled into 2 workers): {same}/{len(prompts)} prompts equal HF")
    blamed = None
    if same != len(prompts):
        blamed = next((part_label(c) for f, c in cap.choice.items() if f.endswith("weight_loader")), None)
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


def smollm2_throughput(cap: Capstone, max_tokens: int = SMOL_TOKENS, repeats: int = 3) -> dict:
    """C.2's four prompts on this CPU, greedy, max_tokens each with ignore_eos: output tokens per second of your
    engine and of the reference engine, each the median of `repeats` generate calls in one engine after one
    warm-up call. Information, not graded: the numbers vary with the machine and its load. Prints one line and
    returns the rates as computed, {"yours": tok/s, "reference": tok/s} (an engine that failed is left out)."""
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
    return rates


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


def _sampler_label(cap: Capstone) -> str | None:
    cand = cap.choice.get("sampler")
    return part_label(cand) if cand else None


# -- E13.1 -------------------------------------------------------------------------------------------------
SECTIONS = ("C.1 HF", "C.1 stream", "C.1 tp=2", "C.2 SmolLM2", "C.3 sampling")


def check_capstone(choose_parts, cap: Capstone) -> None:
    """E13.1: your choose_parts follows the rules (fresh random candidate lists), the capstone above was
    assembled with it, and the engine it assembled passed every section C.1-C.3."""
    check_choose_parts(choose_parts)
    if cap.chooser != "yours":
        fail(TAG, "your choose_parts is right now, but the capstone above was assembled without it (which parts "
                  f"run: {cap.chooser})",
             "run the cell `capstone = ch13.assemble(...)` and the sections after it again")
    for cuda, used in ((False, cap.choice),) + (((True, cap.gpu_choice),) if torch.cuda.is_available() else ()):
        want = reference_choose_parts(cap.candidates, cuda)
        problem = _choice_problem(used, want, cap.candidates, cuda)
        if problem:
            fail(TAG, f"the capstone above ran a choice that breaks a rule: {problem[0]}",
                 "run the cell `capstone = ch13.assemble(...)` again after fixing choose_parts")
    for section in SECTIONS:
        if section not in cap.results:
            fail(TAG, f"section {section} has not run on this capstone", "run the cells of sections C.1-C.3 above, "
                 "after the cell that assembles the capstone, then this check")
        passed, blamed, message = cap.results[section]
        if not passed:
            where = blamed.split(" ")[1].strip("(") if blamed else None
            fail(TAG, f"{section}: {message}" + (f"; the part that does it: {blamed}" if blamed else ""),
                 f"your part passes chapter {where[2:]}'s check, yet breaks the engine in company: run that "
                 "chapter's check cell again, then compare your code with what this section feeds it"
                 if blamed else "read what the section's cell printed above")
    missing = cap.missing()
    if missing:
        print("still the reference's (each chapter grades its own): " + ", ".join(missing))
    ok(TAG)


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import Exercise, exercises  # noqa: E402

# the capstone is made by the notebook's own cells (assemble and the sections C.1-C.3): no reference object
EXERCISES = exercises(
    Exercise("E13.1", check_capstone, ("choose_parts", "capstone")),
)
