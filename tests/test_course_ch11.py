"""Mutation tests of the chapter 11 check helpers (nanovllm_course/ch11.py), and the vLLM peer's argument
plumbing against a stand-in `vllm` module.

Each check passes on the reference (printing exactly its one `E11.n ok` line), fails on a stub with 'not
implemented yet', and fails on each planted plausible mistake with a message and hint that point at it.
"""
import functools
import math

import pytest

import course_checks
from nanovllm_course import ch11
from nanovllm_bench.floor import model_stats, physical_floor

CHECKS = {tag: e.check for tag, e in ch11.EXERCISES.items()}

passes = functools.partial(course_checks.passes_by_tag, CHECKS)
fails = functools.partial(course_checks.fails_by_tag, CHECKS)


REFERENCES = {tag: e.reference[0] for tag, e in ch11.EXERCISES.items()}


@pytest.mark.parametrize("tag", sorted(CHECKS))
def test_reference_passes(tag, capsys):
    passes(tag, REFERENCES[tag], capsys)


@pytest.mark.parametrize("tag", sorted(CHECKS))
def test_stub_is_not_done(tag):
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise")
    fails(tag, stub, "not implemented yet")


# -- E11.1 the floor: the mutants named in the issue, and a few more ----------------------------------------------
def _floor(prompts, max_tokens, config, bw, flops, *, weights_once=False, kv_factor=2, prefill_per_param=2,
           attention=True, lm_head_all=False):
    st = model_stats(config)
    L, Hkv, H, hd = config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads, config.head_dim
    kv_tok = kv_factor * L * Hkv * hd * 2
    kv_bytes = sum(kv_tok * ((m - 1) * len(p) + (m - 1) * m // 2) for p, m in zip(prompts, max_tokens))
    weight_bytes = (1 if weights_once else max(max_tokens) - 1) * 2 * st["params"]
    lens = [len(p) for p in prompts]
    prefill = prefill_per_param * st["layer_params"] * sum(lens) \
        + 2 * st["lm_head_params"] * (sum(lens) if lm_head_all else len(lens)) \
        + (4 * L * H * hd * sum(n * n / 2 for n in lens) if attention else 0)
    out = dict(kv_bytes=kv_bytes, weight_bytes=weight_bytes, prefill_flops=prefill, kv_read_s=kv_bytes / bw,
               weight_read_s=weight_bytes / bw, prefill_s=prefill / flops)
    out["floor_s"] = out["kv_read_s"] + out["weight_read_s"] + out["prefill_s"]
    return out


def test_hand_written_floor_passes(capsys):
    passes("E11.1", _floor, capsys)


def test_floor_weights_read_once():
    fails("E11.1", lambda *a: _floor(*a, weights_once=True), "weight_bytes is one copy of the weights",
          "max(max_tokens) - 1 steps")


def test_floor_kv_factor_2_forgotten():
    fails("E11.1", lambda *a: _floor(*a, kv_factor=1), "kv_bytes is half", "2 (K and V)")


def test_floor_prefill_one_flop_per_param():
    fails("E11.1", lambda *a: _floor(*a, prefill_per_param=1), "1 FLOP per parameter", "2 x params FLOPs")


def test_floor_attention_left_out():
    fails("E11.1", lambda *a: _floor(*a, attention=False), "leaves out attention")


def test_floor_lm_head_on_every_prompt_token():
    fails("E11.1", lambda *a: _floor(*a, lm_head_all=True), "LM head on every prompt token")


def test_floor_wrong_seconds():
    def wrong(*a):
        out = _floor(*a)
        out["floor_s"] = out["kv_read_s"] + out["weight_read_s"]
        return out
    fails("E11.1", wrong, "floor_s is", "the sum of the three parts")


def test_floor_missing_key():
    fails("E11.1", lambda *a: {k: v for k, v in _floor(*a).items() if k != "prefill_s"}, "lacks prefill_s")


# -- E11.2 throughput ---------------------------------------------------------------------------------------
def _throughput(trace, *, warmup=False, mean_of_rates=False, pooled=False):
    steps = [s for s in trace if warmup or not s.warmup]
    out = {}
    for kind in ("prefill", "decode"):
        mine = [s for s in steps if s.kind == kind]
        out[f"{kind}_tokens"] = sum(s.num_tokens for s in mine)
        out[f"{kind}_s"] = sum(s.seconds for s in mine)
        out[f"{kind}_tok_s"] = (sum(s.num_tokens / s.seconds for s in mine) / len(mine) if mean_of_rates
                                else out[f"{kind}_tokens"] / out[f"{kind}_s"])
    if pooled:
        rate = (out["prefill_tokens"] + out["decode_tokens"]) / (out["prefill_s"] + out["decode_s"])
        out["prefill_tok_s"] = out["decode_tok_s"] = rate
    return out


def test_hand_written_throughput_passes(capsys):
    passes("E11.2", _throughput, capsys)


def test_throughput_counts_warmup():
    fails("E11.2", lambda t: _throughput(t, warmup=True), "warm-up steps are counted", "warmup=True")


def test_throughput_mean_of_rates():
    fails("E11.2", lambda t: _throughput(t, mean_of_rates=True), "mean of the per-step rates")


def test_throughput_pooled():
    fails("E11.2", lambda t: _throughput(t, pooled=True), "pooled into one rate")


def test_throughput_decode_counts_steps():
    def steps(trace):
        out = _throughput(trace)
        out["decode_tokens"] = sum(1 for s in trace if s.kind == "decode" and not s.warmup)
        out["decode_tok_s"] = out["decode_tokens"] / out["decode_s"]
        return out
    fails("E11.2", steps, "counts steps, not tokens")


def test_throughput_worked_example_of_the_chapter():
    S = ch11.Step
    r = ch11.reference_throughput([S("prefill", 100, 1.0, True), S("prefill", 64, 0.5), S("decode", 4, 0.25),
                                   S("decode", 4, 0.75)])
    assert (r["prefill_tok_s"], r["decode_tok_s"], r["decode_tokens"]) == (128.0, 8.0, 8)


def test_time_steps_on_the_tiny_engine():
    from nanovllm_course.common import tiny_model_dir
    from nanovllm_ref import LLM, SamplingParams
    llm = LLM(tiny_model_dir("qwen3"), device="cpu", attention_backend="torch", max_model_len=64,
              kvcache_block_size=4, max_num_batched_tokens=8)
    try:
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        trace = ch11.time_steps(llm, [list(range(10, 23)), [5, 6, 7]], sp, warmup_prompts=[[1, 2]], warmup_params=sp)
    finally:
        llm.exit()
    timed = [s for s in trace if not s.warmup]
    assert [s.warmup for s in trace] == sorted((s.warmup for s in trace), reverse=True)   # warm-up first
    assert sum(s.num_tokens for s in timed if s.kind == "prefill") == 16                   # 13 + 3 prompt tokens
    assert sum(s.num_tokens for s in timed if s.kind == "decode") == 2 * 2                 # max_tokens - 1 each
    assert all(s.seconds > 0 for s in trace)


# -- E11.3 the roofline -------------------------------------------------------------------------------------
def test_h200_answer():
    st = model_stats(ch11.qwen3_06b_config())
    assert ch11.reference_compute_bound_batch(st, 4.25e12, 796e12, 0) == pytest.approx(187.3, rel=1e-3)
    assert ch11.reference_compute_bound_batch(st, 4.25e12, 796e12, 512) == math.inf


def test_roofline_swapped_rates():
    fails("E11.3", lambda st, bw, fl, c=0: ch11.reference_compute_bound_batch(st, fl, bw, c), "swapped")


def test_roofline_one_flop_per_param():
    def wrong(st, bw, fl, c=0):
        return ch11.reference_compute_bound_batch(dict(st, params=st["params"] / 2,
                                                       attn_flops_coef=st["attn_flops_coef"] / 2), bw, fl, c)
    fails("E11.3", wrong, "1 FLOP per parameter")


def test_roofline_one_byte_per_param():
    fails("E11.3", lambda st, bw, fl, c=0: ch11.reference_compute_bound_batch(
        dict(st, weight_bytes=st["params"]), bw, fl, c), "1 byte per parameter")


def test_roofline_kv_left_out():
    fails("E11.3", lambda st, bw, fl, c=0: ch11.reference_compute_bound_batch(
        dict(st, kv_bytes_per_token=0), bw, fl, c), "K/V reads are left out")


def roofline_written(rule="<=", rounding=None):
    """E11.3 as a student writes it, with the slope rule `rule` and B rounded by `rounding` (None: not)."""
    def compute_bound_batch(stats, bw, flops, context=0):
        flop_per_seq = 2 * stats["params"] + stats["attn_flops_coef"] * context
        per_seq = flop_per_seq / flops - context * stats["kv_bytes_per_token"] / bw
        if (per_seq <= 0) if rule == "<=" else (per_seq < 0):
            return math.inf
        b = stats["weight_bytes"] / bw / per_seq
        return rounding(b) if rounding else b
    return compute_bound_batch


ROOFLINE_MUTANTS = [(roofline_written(rounding=math.ceil), "rounded up to a whole batch"),
                    (roofline_written(rounding=math.floor), "rounded down to a whole batch"),
                    (roofline_written(rounding=round), "rounded to the nearest whole batch"),
                    (roofline_written(rule="<"), "per_seq <= 0, not < 0")]


def test_roofline_written_form_passes(capsys):
    passes("E11.3", roofline_written(), capsys)


@pytest.mark.parametrize("fn,says", ROOFLINE_MUTANTS, ids=["ceil", "floor", "round", "strict_lt"])
def test_roofline_rounding_and_the_boundary_are_rejected_every_time(fn, says):
    for _ in range(5):                 # the H200 case, a small ridge point and the zero slope are in every call
        fails("E11.3", fn, says)


def test_roofline_boundary_case_has_a_slope_of_exactly_zero():
    import torch
    for seed in range(20):
        _, st, bw, flops, c = ch11._boundary_case(torch.Generator().manual_seed(seed))
        assert (2 * st["params"] + st["attn_flops_coef"] * c) / flops - c * st["kv_bytes_per_token"] / bw == 0.0
        assert ch11.reference_compute_bound_batch(st, bw, flops, c) == math.inf and st["params"] > 0


def test_h200_table_reads_the_committed_results():
    rows = {(r["name"], r["source"]): r["tok_s"] for r in ch11.h200_results()}
    assert round(rows[("hf_transformers[continuous_batching]", "bench_h200.json")]) == 737
    assert round(rows[("nanovllm_ref[triton,cudagraph]", "bench_h200_tp1_2026-11-30.json")]) == 16431
    assert round(rows[("nanovllm_ref[triton,cudagraph,tp2]", "bench_h200_tp2_2026-11-30.json")]) == 8981
    assert round(rows[("nanovllm_ref[triton,cudagraph]", "bench_h200_round2_2026-11-30.json")]) == 19444
    assert round(rows[("nanovllm_ref[triton,cudagraph]", "bench_h200x2_tp1_round2_2026-11-30_call5.json")]) == 19844
    assert round(rows[("nanovllm_ref[triton,cudagraph,tp2]", "bench_h200x2_tp2_round2_2026-11-30_call5.json")]) == 21879
    assert round(rows[("nanovllm_ref[triton:graph]", "bench_h200_peers_2026-12-01_call2.json")]) == 23341
    assert round(rows[("batch-1 decode nanovllm_ref[triton:graph]", "bench_h200_peers_2026-12-01_call2.json")]) == 821
    assert round(rows[("nano-vllm", "bench_h200_peers_2026-12-01_call2.json")]) == 18599
    assert ("vllm", "bench_h200_peers_2026-12-01_call2.json") not in rows          # it failed: no tok/s row
    assert {r["record"] for r in ch11.h200_results()} == {"round 1", "TP host, seams", "round 2", "round 2, TP host",
                                                          "round 3, first look", "round 3, peers", "round 3, peers 2",
                                                          "round 4, peers", "round 4, peers 2"}
    assert [(r["nano_vllm"], r["vllm"]) for r in ch11.PUBLISHED["rows"]] == [(1434, 1362), (8961, 7484)]


def test_floor_matches_the_committed_h200_floor():
    from nanovllm_bench.workload import make_workload
    h200 = ch11.h200_result("bench_h200.json")
    prompts, max_tokens = make_workload(256)
    fl = physical_floor(prompts, max_tokens, model_stats(ch11.qwen3_06b_config()),
                        h200["machine"]["copy_bandwidth_Bps"], h200["machine"]["matmul_flops"])
    assert fl["floor_s"] == pytest.approx(h200["floor"]["floor_s"], rel=1e-9)


def test_roofline_finite_where_never_compute_bound():
    def wrong(st, bw, fl, c=0):
        b = ch11.reference_compute_bound_batch(st, bw, fl, c)
        return 170.0 if math.isinf(b) else b
    fails("E11.3", wrong, "never becomes compute-bound", "math.inf")


# -- issue 22: the hint names the mistake that explains every case --------------------------------------------
def _floor_head_dim(prompts, max_tokens, config, bw, flops, *, everywhere=False):
    """head_dim taken as hidden_size // num_attention_heads (for the K/V only, or for the whole model)."""
    import copy
    wrong = copy.deepcopy(config)
    wrong.head_dim = config.hidden_size // config.num_attention_heads
    st, ws = model_stats(config), model_stats(wrong)
    return physical_floor(prompts, max_tokens, ws if everywhere else dict(st, kv_bytes_per_token=ws["kv_bytes_per_token"]),
                          bw, flops)


def _floor_tied_ignored(prompts, max_tokens, config, bw, flops):
    import copy
    untied = copy.deepcopy(config)
    untied.tie_word_embeddings = False
    st, u = model_stats(config), model_stats(untied)
    return physical_floor(prompts, max_tokens, dict(st, params=u["params"], weight_bytes=u["weight_bytes"]), bw, flops)


def _floor_steps_summed(prompts, max_tokens, config, bw, flops):
    out = _floor(prompts, max_tokens, config, bw, flops)
    out["weight_bytes"] = sum(m - 1 for m in max_tokens) * 2 * model_stats(config)["params"]
    out["weight_read_s"] = out["weight_bytes"] / bw
    out["floor_s"] = out["kv_read_s"] + out["weight_read_s"] + out["prefill_s"]
    return out


@pytest.mark.parametrize("fn,says", [
    (lambda *a: _floor_head_dim(*a), "kv_bytes uses head_dim = hidden_size / num_attention_heads"),
    (lambda *a: _floor_head_dim(*a, everywhere=True), "head_dim taken as hidden_size / num_attention_heads"),
    (_floor_tied_ignored, "the embeddings are tied"),
    (_floor_steps_summed, "each step reads them once for everyone"),
    (lambda *a: _floor(*a, kv_factor=1), "kv_bytes is half"),
], ids=["head_dim_kv", "head_dim_everywhere", "tied_ignored", "steps_summed", "kv_half"])
def test_floor_mutants_get_their_own_hint_every_time(fn, says):
    for _ in range(3):
        text = fails("E11.1", fn, says)
        if "head_dim" in says:
            assert "kv_bytes is half" not in text


# -- every hint of the chapter's checks has a mutant that reaches it --------------------------------------------
def test_floor_not_a_dict():
    fails("E11.1", lambda *a: list(_floor(*a).values()), "should return a dict")


def test_floor_kv_attends_one_position_too_many():
    """Decode token t attends over P + t + 1 positions: no usual mistake explains it, so the message names the key."""
    def wrong(prompts, max_tokens, config, bw, flops):
        out = _floor(prompts, max_tokens, config, bw, flops)
        kv_tok = model_stats(config)["kv_bytes_per_token"]
        out["kv_bytes"] = sum(kv_tok * ((m - 1) * (len(p) + 1) + (m - 1) * m // 2) for p, m in zip(prompts, max_tokens))
        out["kv_read_s"] = out["kv_bytes"] / bw
        out["floor_s"] = out["kv_read_s"] + out["weight_read_s"] + out["prefill_s"]
        return out
    fails("E11.1", wrong, "kv_bytes is", "count per decode token the K/V it reads")


def test_throughput_divided_by_the_whole_run():
    def wall(trace):
        out = _throughput(trace)
        for kind in ("prefill", "decode"):
            out[f"{kind}_tok_s"] = out[f"{kind}_tokens"] / (out["prefill_s"] + out["decode_s"])
        return out
    fails("E11.2", wall, "divides by the whole run's seconds")


def test_throughput_rounded_seconds():
    def rounded(trace):
        out = _throughput(trace)
        out["decode_s"] = round(out["decode_s"], 2)
        out["decode_tok_s"] = out["decode_tokens"] / out["decode_s"]
        return out
    fails("E11.2", rounded, "decode_s is", "the check is exact")


def test_roofline_not_a_number():
    fails("E11.3", lambda st, bw, fl, c=0: str(ch11.reference_compute_bound_batch(st, bw, fl, c)), "should return a float")


def test_roofline_attention_left_out():
    for _ in range(5):
        fails("E11.3", lambda st, bw, fl, c=0: ch11.reference_compute_bound_batch(dict(st, attn_flops_coef=0), bw, fl, c),
              "attention FLOPs are left out")


def test_roofline_weights_read_per_sequence():
    """Memory per step counted as B x weights: no usual mistake explains it."""
    def wrong(st, bw, fl, c=0):
        flop = 2 * st["params"] + st["attn_flops_coef"] * c
        slope = flop / fl - (st["weight_bytes"] + c * st["kv_bytes_per_token"]) / bw
        return math.inf if slope <= 0 else 1.0 / slope
    fails("E11.3", wrong, "returned", "solve memory time = compute time")


# -- issue 30: each plausible wrong answer gets its own hint, in every run ----------------------------------------
def floor_written(kv_positions="right", kv_bytes_per_value=2, kv_layers=True, steps="max - 1", triangle="n^2/2",
                  prefill_rate="flops", floor="sum"):
    """E11.1 as a student writes it from the spec, with one mistake at a time."""
    def workload_floor(prompts, max_tokens, config, bw, flops):
        st = model_stats(config)
        L, Hkv, H, hd = config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads, config.head_dim
        per_token = 2 * (L if kv_layers else 1) * Hkv * hd * kv_bytes_per_value
        positions = {"right": lambda P, M: (M - 1) * P + (M - 1) * M // 2,
                     "one less": lambda P, M: (M - 1) * P + (M - 1) * (M - 2) // 2,
                     "M tokens": lambda P, M: M * P + M * (M - 1) // 2,
                     "t = 1 .. M": lambda P, M: M * P + M * (M + 1) / 2,
                     "prompt only": lambda P, M: (M - 1) * P}[kv_positions]
        kv = sum(per_token * positions(len(p), m) for p, m in zip(prompts, max_tokens))
        n_steps = max(max_tokens) - 1 if steps == "max - 1" else sum(max_tokens) // len(max_tokens)
        weights = n_steps * 2 * st["params"]
        lens = [len(p) for p in prompts]
        pairs = (lambda n: n * n / 2) if triangle == "n^2/2" else (lambda n: n * (n + 1) / 2)
        prefill = (2 * st["layer_params"] * sum(lens) + 2 * st["lm_head_params"] * len(lens)
                   + 4 * L * H * hd * sum(pairs(n) for n in lens))
        out = dict(kv_bytes=kv, weight_bytes=weights, prefill_flops=prefill, kv_read_s=kv / bw,
                   weight_read_s=weights / bw, prefill_s=prefill / (flops if prefill_rate == "flops" else bw))
        parts = (out["kv_read_s"], out["weight_read_s"], out["prefill_s"])
        out["floor_s"] = sum(parts) if floor == "sum" else max(parts)
        return out
    return workload_floor


def throughput_written(mistake=None):
    """E11.2 as a student writes it, with one mistake (None: right)."""
    def throughput(trace):
        timed = trace[1:] if mistake == "first step only" else [s for s in trace if not s.warmup]
        out = dict(prefill_tokens=0, prefill_s=0.0, decode_tokens=0, decode_s=0.0)
        for s in timed:
            out[s.kind + "_tokens"] += s.num_tokens
            out[s.kind + "_s"] += s.seconds if mistake != "warm-up seconds" else 0.0
        if mistake == "warm-up seconds":
            for s in trace:
                out[s.kind + "_s"] += s.seconds
        for kind in ("prefill", "decode"):
            tok, sec = out[kind + "_tokens"], out[kind + "_s"]
            out[kind + "_tok_s"] = sec / tok if mistake == "inverted" else tok / sec
        return out
    return throughput


def roofline_kv_once(st, bw, flops, c=0):
    return (st["weight_bytes"] + c * st["kv_bytes_per_token"]) / bw / ((2 * st["params"] + st["attn_flops_coef"] * c)
                                                                      / flops)


HINT_MUTANTS = [   # (exercise, wrong answer, what its message must say)
    ("E11.1", floor_written(kv_positions="one less"), "counts P + t - 1 positions"),
    ("E11.1", floor_written(kv_positions="M tokens"), "counts M decode tokens per request"),
    ("E11.1", floor_written(kv_positions="t = 1 .. M"), "counts decode tokens t = 1 .. M"),
    ("E11.1", floor_written(kv_positions="prompt only"), "counts only the prompt's K/V"),
    ("E11.1", floor_written(kv_bytes_per_value=4), "counts 4 bytes per cached value"),
    ("E11.1", floor_written(kv_layers=False), "counts one layer's cache"),
    ("E11.1", floor_written(steps="mean"), "counts the mean request's decode steps"),
    ("E11.1", floor_written(triangle="n(n+1)/2"), "as n (n + 1) / 2 pairs"),
    ("E11.1", floor_written(prefill_rate="bw"), "prefill_s divides the FLOPs by the bandwidth"),
    ("E11.1", floor_written(floor="max"), "floor_s is the largest part, not the sum"),
    ("E11.2", throughput_written("first step only"), "only the first step was left out as warm-up"),
    ("E11.2", throughput_written("warm-up seconds"), "the warm-up steps' seconds are counted"),
    ("E11.2", throughput_written("inverted"), "the rates are seconds per token"),
    ("E11.3", roofline_kv_once, "the K/V reads are counted once per step"),
    ("E11.3", lambda st, bw, flops, c=0: flops / bw, "the context is ignored"),
]


def test_written_forms_pass(capsys):
    passes("E11.1", floor_written(), capsys)
    passes("E11.2", throughput_written(), capsys)


@pytest.mark.parametrize("tag,fn,says", HINT_MUTANTS, ids=[f"{m[0]}-{m[2][:24]}" for m in HINT_MUTANTS])
def test_each_mistake_gets_its_own_hint_in_every_run(tag, fn, says):
    for _ in range(3):
        fails(tag, fn, says)
