"""Checks and tools for chapter 11: benchmarking (the physical floor, throughput, the roofline, peers).

- `check_workload_floor(fn)` (E11.1): the student's `workload_floor(prompts, max_tokens, config, bw_bytes_s,
  flops_s)` against `nanovllm_bench.floor.physical_floor(prompts, max_tokens, model_stats(config), ...)` on
  the upstream workload and on fresh random workloads and model shapes (tied and untied embeddings; head_dim
  never hidden / heads, nor twice or half that), every key within **rtol 1e-9**.
- `check_throughput(fn)` (E11.2): the student's `throughput(trace)` against `reference_throughput` on fresh
  random step traces, **exactly** (the traces' seconds are multiples of 1/1024 s, so every sum is exact in
  float64 whatever the order of the additions).
- `check_compute_bound_batch(fn)` (E11.3): the student's `compute_bound_batch(stats, bw_bytes_s, flops_s,
  context)` against `reference_compute_bound_batch` on the H200 and on fresh random machines and contexts,
  within **rtol 1e-6** (`math.inf` where decode never becomes compute-bound); every call has the H200 at context 0
  (B = 187.29) and a drawn ridge point B in [2, 50] with a fractional part (a B rounded to a whole batch is off by
  >= 1.6e-3), and a model whose slope is exactly 0 in float64 (`_boundary_case`: inf, the `<=` of the rule).

Each check prints `E11.n ok` and nothing else on success and draws new inputs on every call. On a wrong
answer it computes the usual wrong answers and names the one that matches the student's answer in every case
(one case alone can make two mistakes look alike), else the first that matches in a failing case.

Tools: `Step` and `time_steps(llm, ...)` (a step trace of the real engine, the format of E11.2),
`reference_*` answers, `h200_results()` (the committed H200 JSONs as one table), `peer_rows` /
`peers_markdown` (a record of `python -m nanovllm_bench`, whose peers include vLLM and upstream nano-vllm, as a
table), `PUBLISHED` (the nano-vllm vs vLLM numbers of the GeeeekExplorer/nano-vllm README), `VLLM_EARLIER` (another
lease) and `VLLM_SAME_CALL` (vLLM and our engine in one call).
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import NamedTuple

from nanovllm_course.common import call_student, fail, fresh_generator, ok, randint
from nanovllm_bench.floor import model_stats, pct_of_floor, physical_floor
from nanovllm_bench.workload import QWEN3_06B, make_workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FLOOR_KEYS = ("kv_bytes", "weight_bytes", "prefill_flops", "kv_read_s", "weight_read_s", "prefill_s", "floor_s")
# Tolerances, set by the mistakes they must tell apart: any reordering of the float64 sums is good to ~1e-15; the
# smallest planted mistake of E11.3, rounding B to a whole batch, moves it by >= 1.6e-3 (H200 at context 0:
# B = 187.29) and by >= 4e-3 in the drawn case with B in [2, 50].
RTOL_FLOOR, RTOL_ROOFLINE = 1e-9, 1e-6

# nano-vllm's own README (github.com/GeeeekExplorer/nano-vllm), same workload (256 requests, Qwen3-0.6B):
PUBLISHED = {
    "source": "GeeeekExplorer/nano-vllm README (benchmark section)",
    "rows": [dict(hardware="RTX 4070 laptop", nano_vllm=1434, vllm=1362),
             dict(hardware="A100-40GB", nano_vllm=8961, vllm=7484)],
}


def qwen3_06b_config():
    """The Qwen3-0.6B shape as a transformers config (what the GPU bench builds, with random weights)."""
    from nanovllm_models.tiny import tiny_config
    return tiny_config("qwen3", **QWEN3_06B)


# -- E11.1 the physical floor --------------------------------------------------------------------------------
def reference_workload_floor(prompts, max_tokens, config, bw_bytes_s, flops_s) -> dict:
    return physical_floor(prompts, max_tokens, model_stats(config), bw_bytes_s, flops_s)


def _floor_mutants(prompts, max_tokens, config, bw, flops) -> list[tuple[str, str, str, str, dict]]:
    """(mistake id, key it shows in first, message, hint, wrong floor) for the usual mistakes; a mistake's id is
    the same in every case (its message may name the case's numbers)."""
    st = model_stats(config)
    out = []

    def variant(**kw):
        s = dict(st, **{k: v for k, v in kw.items() if k in st})
        f = physical_floor(prompts, max_tokens, s, bw, flops)
        return f

    # whole-model slips: the same formulas fed a wrong shape
    hd = config.hidden_size // config.num_attention_heads
    if hd != config.head_dim:
        wrong_hd = model_stats(_with(config, head_dim=hd))
        out.append(("head_dim", "kv_bytes", f"head_dim taken as hidden_size / num_attention_heads = {hd}: Qwen3's head_dim "
                    f"is its own config field ({config.head_dim} here)",
                    "use config.head_dim for the K/V vectors (and the q/k/v/o projections); Qwen3-0.6B has hidden 1024 "
                    "and 16 heads but head_dim 128, not 64", physical_floor(prompts, max_tokens, wrong_hd, bw, flops)))
        out.append(("kv_head_dim", "kv_bytes", f"kv_bytes uses head_dim = hidden_size / num_attention_heads = {hd}: Qwen3's "
                    f"head_dim is its own config field ({config.head_dim} here)",
                    "bytes per cached token = 2 (K and V) x layers x KV heads x config.head_dim x 2 bytes",
                    variant(kv_bytes_per_token=wrong_hd["kv_bytes_per_token"])))
    untied = model_stats(_with(config, tie_word_embeddings=not config.tie_word_embeddings))
    out.append(("tied", "weight_bytes", "the parameter count " + ("adds a separate LM head, but the embeddings are tied "
                "(one [vocab, hidden] matrix serves both)" if config.tie_word_embeddings else "counts the [vocab, "
                "hidden] matrix once, but the embeddings are not tied: the LM head is a second one"),
                "params = layers x per-layer params + vocab x hidden x (1 if tie_word_embeddings else 2)",
                physical_floor(prompts, max_tokens, dict(st, params=untied["params"],
                                                         weight_bytes=untied["weight_bytes"]), bw, flops)))
    summed = dict(physical_floor(prompts, max_tokens, st, bw, flops))
    summed["weight_bytes"] = sum(m - 1 for m in max_tokens) * st["weight_bytes"]
    out.append(("summed", "weight_bytes", "weight_bytes counts one read of the weights per request's decode token; the batch "
                "decodes together, so each step reads them once for everyone",
                "decode steps = max(max_tokens) - 1 (the longest request), weight_bytes = steps x 2 x params", summed))
    once = dict(physical_floor(prompts, max_tokens, st, bw, flops))
    once["weight_bytes"] = st["weight_bytes"]
    out.append(("once", "weight_bytes", "weight_bytes is one copy of the weights: decode reads them again at every step",
                "every decode step streams all weights from memory once; there are max(max_tokens) - 1 steps",
                once))
    steps_all = dict(physical_floor(prompts, max_tokens, st, bw, flops))
    steps_all["weight_bytes"] = max(max_tokens) * st["weight_bytes"]
    out.append(("steps", "weight_bytes", "weight_bytes counts max(max_tokens) decode steps, one too many",
                "the first output token comes out of the prefill, so decode runs max(max_tokens) - 1 steps",
                steps_all))
    out.append(("kv_half", "kv_bytes", "kv_bytes is half the reference's: the cache holds a K and a V vector per token, layer "
                "and KV head", "bytes per cached token = 2 (K and V) x layers x KV heads x head_dim x 2 bytes (bf16)",
                variant(kv_bytes_per_token=st["kv_bytes_per_token"] // 2)))
    out.append(("kv_query_heads", "kv_bytes", "kv_bytes uses the query heads, not the KV heads (GQA shares each K/V head)",
                "Qwen3 caches num_key_value_heads heads per layer, not num_attention_heads",
                variant(kv_bytes_per_token=st["kv_bytes_per_token"] * config.num_attention_heads
                        // config.num_key_value_heads)))
    # prefill: every combination of the usual mistakes (1 FLOP per weight, LM head on every token, attention
    # left out / as a full square / at 1 FLOP per multiply-add), named together
    lens = [len(p) for p in prompts]
    base = dict(physical_floor(prompts, max_tokens, st, bw, flops))
    mistakes = {
        "one": ("prefill_flops counts 1 FLOP per parameter and token: a matmul does a multiply and an add",
                "a linear layer costs 2 x params FLOPs per token"),
        "lm": ("prefill_flops runs the LM head on every prompt token; prefill needs logits only at each prompt's "
               "last position", "the LM head costs 2 x vocab x hidden FLOPs once per prompt"),
        "noattn": ("prefill_flops leaves out attention (QK^T and PV over the causal triangle)",
                   "attention adds 4 x layers x heads x head_dim FLOPs per (query, earlier key) pair, n^2/2 pairs "
                   "per prompt"),
        "square": ("prefill_flops counts the full n x n attention square: causal attention needs only the triangle "
                   "(n^2/2 pairs)", "a query attends to itself and earlier keys only"),
        "halfattn": ("prefill_flops counts attention at 1 FLOP per multiply-add",
                     "QK^T and PV cost 2 x head_dim FLOPs each per (query, key) pair and head"),
    }
    attn = st["attn_flops_coef"] * sum(n * n / 2 for n in lens)
    for lin in (1, 2):
        for head in (1, 2):
            for lm_all in (False, True):
                for a_name, a_factor in ((None, 1), ("noattn", 0), ("square", 2), ("halfattn", 0.5)):
                    names = (["one"] if 1 in (lin, head) else []) + (["lm"] if lm_all else []) + \
                        ([a_name] if a_name else [])
                    if not names:
                        continue
                    f = dict(base)
                    f["prefill_flops"] = lin * st["layer_params"] * sum(lens) + \
                        head * st["lm_head_params"] * (sum(lens) if lm_all else len(lens)) + a_factor * attn
                    out.append(("prefill:" + "+".join(f"{lin}{head}" if n == "one" else n for n in names),
                                "prefill_flops", "; ".join(mistakes[n][0] for n in names), mistakes[names[0]][1], f))
    # K/V positions: the usual miscounts of the (M - 1) P + (M - 1) M / 2 positions a request reads
    kv_tok = st["kv_bytes_per_token"]

    def kv_with(positions):
        f = dict(base)
        f["kv_bytes"] = sum(kv_tok * positions(len(p), m) for p, m in zip(prompts, max_tokens))
        return f
    out.append(("kv_one_less", "kv_bytes", "kv_bytes counts P + t - 1 positions for decode token t: it reads P + t (the "
                "prompt and the t tokens before it, the last written just now)", "decode token t = 1 .. M-1 reads "
                "P + t positions: (M - 1) x P + (M - 1) x M / 2 in all", kv_with(lambda P, M: (M - 1) * P + (M - 1) * (M - 2) // 2)))
    out.append(("kv_all_m", "kv_bytes", "kv_bytes counts M decode tokens per request: the first output token comes out "
                "of the prefill, so decode makes M - 1", "decode token t = 1 .. M-1 reads P + t positions: (M - 1) x P + "
                "(M - 1) x M / 2 in all", kv_with(lambda P, M: M * P + M * (M - 1) // 2)))
    out.append(("kv_m_plus", "kv_bytes", "kv_bytes counts decode tokens t = 1 .. M: the first output token comes out "
                "of the prefill, so decode makes M - 1 tokens, t = 1 .. M-1", "decode token t = 1 .. M-1 reads P + t "
                "positions: (M - 1) x P + (M - 1) x M / 2 in all", kv_with(lambda P, M: M * P + M * (M + 1) // 2)))
    out.append(("kv_prompt_only", "kv_bytes", "kv_bytes counts only the prompt's K/V: each decode token also reads the "
                "K/V of the tokens generated before it (the cache grows by one a step)", "decode token t reads P + t "
                "positions: (M - 1) x P + (M - 1) x M / 2 in all", kv_with(lambda P, M: (M - 1) * P)))
    out.append(("kv_fp32", "kv_bytes", "kv_bytes counts 4 bytes per cached value: the cache is bf16, 2 bytes",
                "bytes per cached token = 2 (K and V) x layers x KV heads x head_dim x 2 bytes (bf16)",
                variant(kv_bytes_per_token=2 * st["kv_bytes_per_token"])))
    out.append(("kv_one_layer", "kv_bytes", "kv_bytes counts one layer's cache: every layer keeps its own K and V",
                "bytes per cached token = 2 (K and V) x num_hidden_layers x KV heads x head_dim x 2 bytes",
                variant(kv_bytes_per_token=st["kv_bytes_per_token"] // config.num_hidden_layers)))
    for less in (1, 0):
        mean_steps = dict(base)
        mean_steps["weight_bytes"] = (sum(max_tokens) / len(max_tokens) - less) * st["weight_bytes"]
        out.append((f"steps_mean_{less}", "weight_bytes", "weight_bytes counts the mean request's decode steps: the "
                    "batch decodes until its longest request is done", "decode steps = max(max_tokens) - 1", mean_steps))
        mean_steps = dict(base)
        mean_steps["weight_bytes"] = (sum(max_tokens) // len(max_tokens) - less) * st["weight_bytes"]
        out.append((f"steps_mean_int_{less}", "weight_bytes", "weight_bytes counts the mean request's decode steps: "
                    "the batch decodes until its longest request is done", "decode steps = max(max_tokens) - 1",
                    mean_steps))
    triangle = dict(base)
    triangle["prefill_flops"] = base["prefill_flops"] + st["attn_flops_coef"] * sum(n / 2 for n in lens)
    out.append(("prefill:n(n+1)/2", "prefill_flops", "prefill_flops counts the causal triangle as n (n + 1) / 2 pairs; "
                "the floor's convention is n^2 / 2 (the spec's)", "attention FLOPs = 4 x layers x heads x head_dim x "
                "n^2 / 2 per prompt of n tokens", triangle))
    for *_, f in out:
        f["kv_read_s"], f["weight_read_s"] = f["kv_bytes"] / bw, f["weight_bytes"] / bw
        f["prefill_s"] = f["prefill_flops"] / flops
        f["floor_s"] = f["kv_read_s"] + f["weight_read_s"] + f["prefill_s"]
    # seconds: the counts right, the division or the sum wrong
    for mistake, key, message, hint, fix in (
            ("prefill_by_bw", "prefill_s", "prefill_s divides the FLOPs by the bandwidth", "prefill_s = prefill_flops / "
             "flops_s; only the byte counts go over bw_bytes_s", lambda f: dict(f, prefill_s=f["prefill_flops"] / bw)),
            ("reads_by_flops", "kv_read_s", "the read times divide the bytes by the FLOP rate", "kv_read_s = kv_bytes / "
             "bw_bytes_s and weight_read_s = weight_bytes / bw_bytes_s", lambda f: dict(
                 f, kv_read_s=f["kv_bytes"] / flops, weight_read_s=f["weight_bytes"] / flops)),
            ("floor_max", "floor_s", "floor_s is the largest part, not the sum: the floor's three costs come one after "
             "another (the model is memory- or compute-bound in turn, not both at once)", "floor_s = kv_read_s + "
             "weight_read_s + prefill_s", lambda f: f)):
        f = fix(dict(base))
        f["floor_s"] = (max(f["kv_read_s"], f["weight_read_s"], f["prefill_s"]) if mistake == "floor_max" else
                        f["kv_read_s"] + f["weight_read_s"] + f["prefill_s"])
        out.append((mistake, key, message, hint, f))
    return out


def _with(config, **fields):
    """A copy of the transformers config with some fields changed."""
    import copy
    c = copy.deepcopy(config)
    for k, v in fields.items():
        setattr(c, k, v)
    return c


def _fmt(x) -> str:
    return f"{x:.6g}" if isinstance(x, (int, float)) else f"a {type(x).__name__}"


def _close(a, e, rtol):
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) and math.isfinite(e) \
        and abs(a - e) <= rtol * abs(e)


def _random_config(g, tie=None, not_group=None):
    """A random Qwen3 shape whose head_dim is neither hidden / heads nor twice or half that (so a head_dim taken
    from hidden_size, or a factor 2 dropped, cannot pass for the other). not_group: a GQA group size (heads per KV
    head) the shape must not have."""
    from nanovllm_models.tiny import tiny_config
    hkv = randint(g, 1, 4)
    group = randint(g, 1, 4)
    while group == not_group:
        group = randint(g, 1, 4)
    heads = hkv * group
    hidden = 16 * randint(g, 2, 12)
    head_dim = 8 * randint(g, 1, 8)
    while head_dim * heads in (hidden, 2 * hidden, hidden // 2):
        head_dim = 8 * randint(g, 1, 8)
    return tiny_config("qwen3", vocab_size=randint(g, 500, 4000), hidden_size=hidden,
                       intermediate_size=16 * randint(g, 3, 30), num_hidden_layers=randint(g, 1, 6),
                       num_attention_heads=heads, num_key_value_heads=hkv, head_dim=head_dim,
                       tie_word_embeddings=bool(randint(g, 0, 1)) if tie is None else tie)


def _check_keys(tag: str, got, name: str, keys) -> None:
    """Fail unless `got` (what `name` returned) is a dict holding every key of `keys`."""
    if not isinstance(got, dict):
        fail(tag, f"{name} should return a dict, got {type(got).__name__}", f"return a dict with the keys {', '.join(keys)}")
    missing = [k for k in keys if k not in got]
    if missing:
        fail(tag, f"the returned dict lacks {', '.join(missing)}", f"return the keys {', '.join(keys)}")


def check_workload_floor(fn) -> None:
    tag = "E11.1"
    g = fresh_generator()
    cases = [("the bench workload (256 requests) on Qwen3-0.6B at 4.25 TB/s, 796 TFLOP/s",
              *make_workload(256), qwen3_06b_config(), 4.25e12, 796e12)]
    for i in range(4):
        n = randint(g, 1, 12)
        prompts, max_tokens = make_workload(n, seed=randint(g, 0, 10**6), min_len=1, max_len=300, min_out=1,
                                            max_out=200)
        # Tied and untied embeddings, every call; and one group size other than 2, since on a group of 2 (Qwen3-0.6B's)
        # the query heads for the KV heads give the same bytes as 4 bytes a value.
        cfg = _random_config(g, tie=(i % 2 == 0), not_group=2 if i == 0 else None)
        cases.append((f"{n} random requests on a random {cfg.num_hidden_layers}-layer model", prompts, max_tokens,
                      cfg, float(randint(g, 50, 5000)) * 1e9, float(randint(g, 1, 1000)) * 1e12))
    results = []
    for what, prompts, max_tokens, cfg, bw, flops in cases:
        expected = reference_workload_floor(prompts, max_tokens, cfg, bw, flops)
        got = call_student(tag, fn, [list(p) for p in prompts], list(max_tokens), cfg, bw, flops)
        _check_keys(tag, got, "workload_floor", FLOOR_KEYS)
        results.append((what, prompts, max_tokens, cfg, bw, flops, got, expected,
                        [k for k in FLOOR_KEYS if not _close(got[k], expected[k], RTOL_FLOOR)]))
    failing = [r for r in results if r[-1]]
    if not failing:
        ok(tag)
        return
    # A mistake that explains every case, every key (one case alone can hide one mistake behind another: on
    # Qwen3-0.6B, hidden / heads is exactly half of head_dim).
    per_case = [{m[0]: m for m in _floor_mutants(*r[1:6])} for r in results]
    for mistake, (_, key, message, hint, _) in per_case[0].items():
        if all(_explains(r, m.get(mistake)) for r, m in zip(results, per_case)):
            mine = per_case[results.index(failing[0])].get(mistake)
            fail(tag, f"{(mine or per_case[0][mistake])[2]} ({failing[0][0]})", hint)
    for r, mutants in zip(results, per_case):
        if not r[-1]:
            continue
        what, got, expected, bad = r[0], r[6], r[7], r[8]
        for _, key, message, hint, wrong in mutants.values():
            if key in bad and _close(got[key], wrong[key], 1e-6):
                fail(tag, f"{message} ({what})", hint)
        first = bad[0]
        if first in ("kv_read_s", "weight_read_s", "prefill_s", "floor_s") and not any(
                k in bad for k in ("kv_bytes", "weight_bytes", "prefill_flops")):
            fail(tag, f"{first} is {_fmt(got[first])}, expected {expected[first]:.6g} ({what}), though the byte "
                      "and FLOP counts are right", "seconds = bytes / bw_bytes_s or FLOPs / flops_s, and floor_s "
                      "is the sum of the three parts")
        fail(tag, f"{first} is {_fmt(got[first])}, expected {expected[first]:.6g} ({what}; rtol {RTOL_FLOOR:g})",
             "count per decode token the K/V it reads, per decode step the weights, per prompt the prefill FLOPs")


def _explains(result, mutant) -> bool:
    """True when `mutant` (None: that mistake changes nothing in this case) gives the student's whole dict."""
    got, bad = result[6], result[8]
    if mutant is None:
        return not bad
    return all(_close(got[k], mutant[4][k], 1e-6) for k in FLOOR_KEYS)


# -- E11.2 throughput from a step trace ----------------------------------------------------------------------
class Step(NamedTuple):
    """One `LLM.step()`: `kind` "prefill" or "decode", `num_tokens` the tokens it computed (prefill: prompt
    tokens of the chunk; decode: the batch size, one new token per sequence), `seconds` its wall time, and
    `warmup` True for the steps of the warm-up run (left out of the throughput)."""
    kind: str
    num_tokens: int
    seconds: float
    warmup: bool = False


THROUGHPUT_KEYS = ("prefill_tokens", "prefill_s", "prefill_tok_s", "decode_tokens", "decode_s", "decode_tok_s")


def reference_throughput(trace) -> dict:
    r = dict(prefill_tokens=0, prefill_s=0.0, decode_tokens=0, decode_s=0.0)
    for s in trace:
        if not s.warmup:
            r[f"{s.kind}_tokens"] += s.num_tokens
            r[f"{s.kind}_s"] += s.seconds
    for kind in ("prefill", "decode"):
        r[f"{kind}_tok_s"] = r[f"{kind}_tokens"] / r[f"{kind}_s"]
    return r


def time_steps(llm, prompts, sampling_params, warmup_prompts=None, warmup_params=None) -> list[Step]:
    """Run `prompts` through `llm` step by step (after an optional warm-up run, marked warmup=True) and
    return one Step per `llm.step()`: its kind and tokens from `llm.last_step` (the step's StepStats), its wall
    time."""
    import torch
    sync = torch.cuda.synchronize if llm.model_runner.device_type == "cuda" else (lambda: None)
    trace = []
    runs = ([(warmup_prompts, warmup_params, True)] if warmup_prompts else []) + [(prompts, sampling_params, False)]
    for ps, sp, warm in runs:
        sps = sp if isinstance(sp, list) else [sp] * len(ps)
        for p, s in zip(ps, sps):
            llm.add_request(p, s)
        while not llm.is_finished():
            sync()
            t = time.perf_counter()
            llm.step()
            sync()
            trace.append(Step(llm.last_step.kind, llm.last_step.num_tokens, time.perf_counter() - t, warm))
    return trace


def _random_trace(g) -> list[Step]:
    trace = []
    for warm in (True, False):
        n = randint(g, 2, 40)
        for _ in range(n):
            kind = "prefill" if randint(g, 0, 3) == 0 else "decode"
            tokens = randint(g, 1, 4096) if kind == "prefill" else randint(g, 1, 256)
            seconds = randint(g, 1, 4000 if kind == "prefill" else 80) / 1024
            trace.append(Step(kind, tokens, seconds, warm))
    for kind in ("prefill", "decode"):          # at least one timed step of each kind
        trace.append(Step(kind, randint(g, 1, 512), randint(g, 1, 60) / 1024, False))
    order = torch_perm(g, len(trace))
    warm = [trace[i] for i in order if trace[i].warmup]
    timed = [trace[i] for i in order if not trace[i].warmup]
    return warm + timed


def torch_perm(g, n):
    import torch
    return torch.randperm(n, generator=g).tolist()


def _throughput_mutants(trace) -> list[tuple[str, str, dict]]:
    out = []
    with_warm = reference_throughput([s._replace(warmup=False) for s in trace])
    out.append(("the warm-up steps are counted", "skip the steps with warmup=True: they include one-time work "
                "(compilation, allocation, graph capture)", with_warm))
    timed = [s for s in trace if not s.warmup]
    mean = reference_throughput(timed)
    for kind in ("prefill", "decode"):
        rates = [s.num_tokens / s.seconds for s in timed if s.kind == kind]
        mean[f"{kind}_tok_s"] = sum(rates) / len(rates)
    out.append(("a tok/s is the mean of the per-step rates", "throughput = total tokens / total seconds; a mean of "
                "rates gives a short step as much weight as a long one", mean))
    pooled = reference_throughput(timed)
    tok = pooled["prefill_tokens"] + pooled["decode_tokens"]
    sec = pooled["prefill_s"] + pooled["decode_s"]
    for kind in ("prefill", "decode"):
        pooled[f"{kind}_tok_s"] = tok / sec
    out.append(("prefill and decode are pooled into one rate", "sum tokens and seconds separately for each kind",
                pooled))
    steps = reference_throughput(timed)
    steps["decode_tokens"] = sum(1 for s in timed if s.kind == "decode")
    steps["decode_tok_s"] = steps["decode_tokens"] / steps["decode_s"]
    out.append(("decode_tokens counts steps, not tokens", "a decode step makes one token per sequence in the batch: "
                "num_tokens of that step", steps))
    wall = reference_throughput(timed)
    for kind in ("prefill", "decode"):
        wall[f"{kind}_tok_s"] = wall[f"{kind}_tokens"] / (wall["prefill_s"] + wall["decode_s"])
    out.append(("each rate divides by the whole run's seconds", "divide a kind's tokens by that kind's seconds", wall))
    inverted = reference_throughput(timed)
    for kind in ("prefill", "decode"):
        inverted[f"{kind}_tok_s"] = inverted[f"{kind}_s"] / inverted[f"{kind}_tokens"]
    out.append(("the rates are seconds per token", "tok/s = tokens / seconds", inverted))
    warm_s = reference_throughput(timed)
    for kind in ("prefill", "decode"):
        warm_s[f"{kind}_s"] = sum(s.seconds for s in trace if s.kind == kind)
        warm_s[f"{kind}_tok_s"] = warm_s[f"{kind}_tokens"] / warm_s[f"{kind}_s"]
    out.append(("the warm-up steps' seconds are counted (their tokens are not)", "skip a warm-up step entirely: "
                "neither its tokens nor its seconds", warm_s))
    by_position = reference_throughput([s._replace(warmup=i == 0) for i, s in enumerate(trace)])
    out.append(("only the first step was left out as warm-up", "the warm-up is every step with warmup=True (a whole "
                "warm-up run, not one step): filter on the flag", by_position))
    return out


def check_throughput(fn) -> None:
    tag = "E11.2"
    g = fresh_generator()
    for case in range(6):
        trace = _random_trace(g)
        expected = reference_throughput(trace)
        got = call_student(tag, fn, list(trace))
        _check_keys(tag, got, "throughput", THROUGHPUT_KEYS)
        bad = [k for k in THROUGHPUT_KEYS if got[k] != expected[k]]
        if not bad:
            continue
        mutants = _throughput_mutants(trace)
        # the mistake that gives every key first (two can agree on the wrong keys alone), then one for the wrong keys
        for keys in (THROUGHPUT_KEYS, bad):
            for message, hint, wrong in mutants:
                if all(got[k] == wrong[k] or _close(got[k], wrong[k], 1e-9) for k in keys):
                    fail(tag, f"{message} (random trace of {len(trace)} steps)", hint)
        k = bad[0]
        fail(tag, f"{k} is {_fmt(got[k])}, expected {expected[k]:.10g} (random trace of {len(trace)} steps; the check is "
                  "exact)", "per kind: add up num_tokens and seconds of the timed steps, then divide")
    ok(tag)


# -- E11.3 the roofline --------------------------------------------------------------------------------------
def reference_compute_bound_batch(stats, bw_bytes_s, flops_s, context=0) -> float:
    """Smallest decode batch B at which a decode step's FLOPs take as long as its memory traffic.

    Per step at batch B, every sequence with `context` cached tokens: memory = weights + B x context x KV bytes
    per token; FLOPs = B x (2 x params + attention: attn_flops_coef x context)."""
    flop_per_seq = 2 * stats["params"] + stats["attn_flops_coef"] * context
    kv_per_seq = context * stats["kv_bytes_per_token"]
    slope = flop_per_seq / flops_s - kv_per_seq / bw_bytes_s
    if slope <= 0:
        return math.inf
    return stats["weight_bytes"] / bw_bytes_s / slope


def step_time(stats, batch, bw_bytes_s, flops_s, context=0) -> float:
    """The roofline's seconds for one decode step: max(memory time, compute time)."""
    mem = (stats["weight_bytes"] + batch * context * stats["kv_bytes_per_token"]) / bw_bytes_s
    comp = batch * (2 * stats["params"] + stats["attn_flops_coef"] * context) / flops_s
    return max(mem, comp)


def _roofline_mutants(stats, bw, flops, context) -> list[tuple[str, str, float]]:
    ref = reference_compute_bound_batch
    no_kv = dict(stats, kv_bytes_per_token=0)
    right = ref(stats, bw, flops, context)
    whole = "return B as a float, not rounded to a whole batch: the check compares the crossing point itself"
    return [
        ("B was rounded up to a whole batch (math.ceil)", whole, math.ceil(right) if math.isfinite(right) else right),
        ("B was rounded down to a whole batch", whole, math.floor(right) if math.isfinite(right) else right),
        ("B was rounded to the nearest whole batch", whole, round(right) if math.isfinite(right) else right),
        ("the bandwidth and the FLOP rate are swapped", "compute time = FLOPs / flops_s, memory time = bytes / bw",
         ref(stats, flops, bw, context)),
        ("1 FLOP per parameter and token: a matmul does a multiply and an add",
         "FLOPs per sequence per step = 2 x params (+ attention)",
         ref(dict(stats, params=stats["params"] / 2, attn_flops_coef=stats["attn_flops_coef"] / 2), bw, flops, context)),
        ("the weights are counted as 1 byte per parameter: they are bf16, 2 bytes",
         "memory per step = weight_bytes (= 2 x params) + the K/V the batch reads",
         ref(dict(stats, weight_bytes=stats["params"]), bw, flops, context)),
        ("the K/V reads are left out: every sequence also reads its own cached K/V each step, and that grows with "
         "the batch", "memory per step = weight_bytes + B x context x kv_bytes_per_token", ref(no_kv, bw, flops, context)),
        ("the attention FLOPs are left out", "FLOPs per sequence = 2 x params + attn_flops_coef x context",
         ref(dict(stats, attn_flops_coef=0), bw, flops, context)),
        ("the K/V reads are counted once per step, not once per sequence", "each sequence reads its own cached K/V: "
         "memory per step = weight_bytes + B x context x kv_bytes_per_token, which grows with B",
         (stats["weight_bytes"] + context * stats["kv_bytes_per_token"]) / bw /
         ((2 * stats["params"] + stats["attn_flops_coef"] * context) / flops)),
        ("the context is ignored: flops_s / bw_bytes_s is the ridge point at context 0 only", "with a context, each "
         "sequence adds context x kv_bytes_per_token bytes and attn_flops_coef x context FLOPs: solve memory time = "
         "compute time with both", flops / bw),
    ]


def _boundary_case(g):
    """A model and machine where one more sequence adds exactly as much memory time as compute time at context c:
    flop_per_seq / flops_s == c * kv_bytes_per_token / bw_bytes_s in float64 (powers of two and integers), so the
    slope is exactly 0 and decode is never compute-bound (math.inf: `<= 0`, not `< 0`)."""
    st = model_stats(_random_config(g))
    c, kv, coef = 2 * randint(g, 32, 1024), st["kv_bytes_per_token"], st["attn_flops_coef"]
    m = 2 ** max(1, math.ceil(math.log2(coef / kv)) + 2)           # flops_s = m * bw_bytes_s, m a power of two
    params = c * (kv * m - coef) // 2                               # 2 params + coef c = c kv m
    bw = float(2 ** 40)
    return (f"a model whose K/V reads per sequence at context {c} take exactly as long as its FLOPs (the slope is 0)",
            dict(st, params=params, weight_bytes=2 * params), bw, bw * m, c)


def _small_batch_case(g):
    """Context 0 on a machine whose ridge point B = flops_s / bw_bytes_s is a small batch with a fractional part:
    rounding it to a whole batch moves it by >= 4e-3."""
    st = model_stats(_random_config(g))
    b = randint(g, 2, 49) + 0.2 + 0.6 * float(torch_rand(g))
    bw = randint(g, 100, 5000) * 1e9
    return f"a random model, context 0, ridge point B = {b:.3f}", st, bw, bw * b, 0


def torch_rand(g) -> float:
    import torch
    return float(torch.rand(1, generator=g))


def check_compute_bound_batch(fn) -> None:
    tag = "E11.3"
    g = fresh_generator()
    h200 = model_stats(qwen3_06b_config())
    cases = [("Qwen3-0.6B on the H200, context 0", h200, 4.25e12, 796e12, 0),
             ("Qwen3-0.6B on the H200, context 512", h200, 4.25e12, 796e12, 512),
             # B = 200.64 here and 187.29 on the H200: one rounds up, the other down, so rounding to the
             # nearest whole batch is never mistaken for always rounding up or down, whatever the random draws
             ("Qwen3-0.6B on an A100-40GB, context 0", h200, 1.555e12, 312e12, 0),
             _small_batch_case(g), _boundary_case(g)]
    for i in range(5):
        st = model_stats(_random_config(g))
        # contexts 0, 0, short, long, any: the K/V and attention terms matter in three cases of every call
        ctx = [0, 0, randint(g, 1, 64), randint(g, 65, 4000), [0, randint(g, 1, 4000)][randint(g, 0, 1)]][i]
        if i == 3:              # a long context whose attention FLOPs are at least half the weights' FLOPs
            ctx = max(ctx, -(-st["params"] // st["attn_flops_coef"]))
        bw, flops = randint(g, 100, 5000) * 1e9, randint(g, 10, 2000) * 1e12
        if ctx and (i in (2, 3) or randint(g, 0, 1)):     # a case that turns compute-bound: low KV, slow FLOPs
            st = dict(st, kv_bytes_per_token=max(1, st["kv_bytes_per_token"] // 64))
            flops = bw * randint(g, 20, 200)
        if i == 3:              # compute-bound for sure: a sequence's K/V reads take half the time of its FLOPs
            flop_per_seq = 2 * st["params"] + st["attn_flops_coef"] * ctx
            flops = bw * flop_per_seq / (2 * ctx * st["kv_bytes_per_token"])
        cases.append((f"a random model, context {ctx}, {bw / 1e12:.2g} TB/s, {flops / 1e12:.3g} TFLOP/s",
                      st, bw, flops, ctx))
    def same(got, want, rtol):
        return (math.isinf(want) and math.isinf(got) and got > 0) or (math.isfinite(want) and _close(got, want, rtol))
    results = []
    for what, st, bw, flops, ctx in cases:
        expected = reference_compute_bound_batch(st, bw, flops, ctx)
        try:
            got = call_student(tag, fn, dict(st), bw, flops, ctx)
        except ZeroDivisionError:
            if math.isinf(expected):
                fail(tag, f"your code divided by zero ({what})", "when one more sequence adds at least as much memory "
                     "time as compute time (per_seq <= 0, not < 0), decode is never compute-bound: return math.inf "
                     "before dividing")
            raise
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            fail(tag, f"compute_bound_batch should return a float, got {type(got).__name__}",
                 "return the batch size as a float (math.inf when never compute-bound)")
        results.append((what, got, expected, _roofline_mutants(st, bw, flops, ctx)))
    failing = [r for r in results if not same(r[1], r[2], RTOL_ROOFLINE)]
    if failing:
        # The usual mistake that gives the student's answer in every case, if one does.
        for i, (message, hint, _) in enumerate(results[0][3]):
            if all(same(got, mutants[i][2], 1e-9) for _, got, _, mutants in results):
                fail(tag, f"{message} ({failing[0][0]})", hint)
    for what, got, expected, mutants in failing:
        for message, hint, wrong in mutants:
            if same(got, wrong, 1e-9):
                fail(tag, f"{message} ({what})", hint)
        if math.isinf(expected):
            fail(tag, f"returned {_fmt(got)} where decode never becomes compute-bound ({what})",
                 "each extra sequence adds its K/V reads too; when they take at least as long as its FLOPs (<= 0, "
                 "not < 0: equal never catches up either), no batch size is compute-bound: return math.inf")
        fail(tag, f"returned {_fmt(got)}, expected {expected:.6g} ({what}; rtol {RTOL_ROOFLINE:g})",
             "solve memory time = compute time for B, both linear in B")
    ok(tag)


# -- the committed H200 results ------------------------------------------------------------------------------
# The committed H200 records, oldest first, with the short name the table gives each.
H200_RECORDS = (
    ("bench_h200.json", "round 1"),
    ("bench_h200_tp1_2026-11-30.json", "TP host, seams"),
    ("bench_h200_tp2_2026-11-30.json", "TP host, seams"),
    ("bench_h200_round2_2026-11-30.json", "round 2"),
    ("bench_h200x2_tp1_round2_2026-11-30_call5.json", "round 2, TP host"),
    ("bench_h200x2_tp2_round2_2026-11-30_call5.json", "round 2, TP host"),
    ("bench_h200_round3_smoke_2026-12-01.json", "round 3, first look"),
    ("bench_h200_peers_2026-12-01_call2.json", "round 3, peers"),
    ("bench_h200_peers_2026-12-01_call4.json", "round 3, peers 2"),
    ("bench_h200_peers_2026-12-02.json", "round 4, peers"),
    ("bench_h200_peers_2026-12-02_prefill_graphs.json", "round 4, peers 2"),
)
# The round-3 record with every peer in one call (chapter 11's peers table; its vLLM row failed, see the chapter).
PEERS_RECORD = "bench_h200_peers_2026-12-01_call2.json"
# vLLM on the same workload, same H200 kind, same day, in an earlier lease, measured with stand-alone scripts
# before the harness had its vLLM peer (our engine at 45c6c05 ran 18,995 tok/s, batch-1 523, in that lease):
# the latest vLLM numbers there are until a call of `python -m nanovllm_bench` records vLLM's row itself.
VLLM_EARLIER = dict(version="0.20.2", date="2026-12-01", tok_s=18_770, min_tok_s=18_610, max_tok_s=19_386,
                    batch1_tok_s=506, ours_then=18_995, ours_then_commit="45c6c05")
# vLLM and our engine side by side in one call (`bench/gpu_run.sh peers` at e345f4e, 2026-12-02, median of 3;
# bench_h200_peers_2026-12-02_prefill_graphs.json): the only kind of record a ratio between two engines may come
# from. VLLM_EARLIER is from another lease. Earlier such calls gave 1.04x (issue 29, ae49a08, 2026-12-01: vLLM
# 22,080, ours 22,967) and 1.11x (879ea8c, 2026-12-02: 20,953 and 23,336): two calls of the same two engines
# differ by several per cent, vLLM's more than ours.
VLLM_SAME_CALL = dict(version="0.20.2", date="2026-12-02", commit="e345f4e", tok_s=21_412, min_tok_s=21_113,
                      max_tok_s=21_488, batch1_tok_s=557, ours=24_003, ours_min=23_419, ours_max=24_142,
                      ours_batch1=952, nano_vllm=19_118, nano_vllm_batch1=471,
                      record="bench_h200_peers_2026-12-02_prefill_graphs.json")


def h200_results(folder: Path = RESULTS) -> list[dict]:
    """Rows (name, tok_s, pct_of_floor, source, record, date) from the committed H200 JSONs of H200_RECORDS:
    each engine run, HF continuous batching, batch-1 decode and TP=2. `record` is the short name of the file
    (round 1, the seams refactor, round 2; "TP host": measured on the two-H200 machine)."""
    rows = []
    for fname, record in H200_RECORDS:
        d = json.loads((Path(folder) / fname).read_text())
        for r in d["runs"]:
            if r.get("tok_s"):
                # % of the floor of the GPUs the run used (the TP records of 2026-11-30 predate `floor_gpus`
                # and stored a pct_of_floor against one GPU's floor: their GPU count is in the run's name).
                m = re.search(r",tp(\d+)\]", r["name"])
                gpus = r.get("floor_gpus") or (int(m.group(1)) if m else 1)
                rows.append(dict(name=r["name"], tok_s=r["tok_s"],
                                 pct_of_floor=pct_of_floor(d["floor"]["floor_s"], r["seconds"], gpus),
                                 source=fname, record=record, date=d["date"]))
                if r.get("batch1_tok_s"):            # the peers records (2026-12-01 on): batch-1 per row
                    rows.append(dict(name=f"batch-1 decode {r['name']}", tok_s=r["batch1_tok_s"], pct_of_floor=None,
                                     source=fname, record=record, date=d["date"]))
        if "decode_batch1" in d:
            b = d["decode_batch1"]
            rows.append(dict(name=f"batch-1 decode [{b['backend']},{'cudagraph' if b['cuda_graphs'] else 'eager'}]",
                             tok_s=b["tok_s"], pct_of_floor=None, source=fname, record=record, date=d["date"]))
    return rows


def h200_result(fname="bench_h200.json", folder: Path = RESULTS) -> dict:
    return json.loads((Path(folder) / fname).read_text())


def peer_rows(record: dict) -> list[dict]:
    """One row per peer of a benchmark record (nanovllm_bench's JSON): name, family (nanovllm_ref, vllm,
    nano-vllm, hf), tok/s median with min and max, batch-1 tok/s, % of floor, start-up seconds, the peer's
    version (nanovllm_ref: its commit), torch / transformers versions, the record's date and machine; a peer
    that did not run keeps its status and reason."""
    rows = []
    for r in record["runs"]:
        v = r.get("versions") or {}
        family = r.get("peer") or next((f for f in ("nanovllm_ref", "vllm", "nano-vllm", "hf")
                                        if r["name"].startswith(f if f != "hf" else "hf_")), "other")
        rows.append(dict(name=r["name"], family=family, status=r.get("status", "ok" if r.get("tok_s") else "failed"),
                         tok_s=r.get("tok_s"), min_tok_s=r.get("min_tok_s"), max_tok_s=r.get("max_tok_s"),
                         repeats=r.get("repeats"), batch1_tok_s=r.get("batch1_tok_s"), pct_of_floor=r.get("pct_of_floor"),
                         startup_s=r.get("startup_s"), version=v.get("peer") if family != "nanovllm_ref" else
                         (v.get("commit") or v.get("peer")), torch=v.get("torch"), transformers=v.get("transformers"),
                         reason=r.get("reason") or r.get("error"), date=record["date"],
                         machine=record["machine"].get("device_name")))
    return rows


def reason_line(reason: str | None, width: int = 90) -> str:
    """The line of a peer's failure reason worth a table cell: the exception line of a traceback
    (`RuntimeError: Engine core initialization failed...`) when there is one, else the first line."""
    lines = [l.strip() for l in (reason or "").splitlines() if l.strip()]
    if not lines:
        return ""
    exc = [l for l in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", l)]
    head = lines[0].split(";")[0]                    # "exit 1", "ran past 141 s"
    text = f"{head}: {exc[-1]}" if exc else lines[0]
    return text if len(text) <= width else text[:width - 3] + "..."


def peers_markdown(record: dict) -> str:
    """The record's peers as a markdown table (what chapter 11 and the README show)."""
    lines = [f"{record['machine'].get('device_name')}, {record['date']}, {record['workload']['num_requests']} requests, "
             f"{record['workload']['output_tokens']:,} output tokens",
             "", "| engine | version | tok/s, median (min-max) | % of floor | batch-1 tok/s | start-up |",
             "|---|---|---|---|---|---|"]
    for r in peer_rows(record):
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['version'] or ''} | {r['status']}: {reason_line(r['reason'])} | | | |")
            continue
        pct = f"{r['pct_of_floor']:.1f} %" if r["pct_of_floor"] else ""
        b1 = f"{r['batch1_tok_s']:,.0f}" if r["batch1_tok_s"] else ""
        lines.append(f"| {r['name']} | {r['version'] or ''} | {r['tok_s']:,.0f} ({r['min_tok_s']:,.0f}-"
                     f"{r['max_tok_s']:,.0f}) | {pct} | {b1} | {r['startup_s']:.0f} s |")
    return "\n".join(lines)


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import Exercise, exercises  # noqa: E402

EXERCISES = exercises(
    Exercise("E11.1", check_workload_floor, ("workload_floor",), (reference_workload_floor,)),
    Exercise("E11.2", check_throughput, ("throughput",), (reference_throughput,)),
    Exercise("E11.3", check_compute_bound_batch, ("compute_bound_batch",), (reference_compute_bound_batch,)),
)
