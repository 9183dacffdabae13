"""Mutation tests of the chapter 12 check helpers (nanovllm_course/ch12.py, serving).

Each check passes on the reference (printing exactly its one `E12.n ok` line), fails on a stub with 'not
implemented yet', and fails on each planted plausible mistake with a message and hint that point at it.
Each check draws fresh inputs per call, so every mistake is tried on several calls.
"""
import functools
import json

import pytest

import course_checks
from nanovllm_course import ch12

CHECKS = {tag: e.check for tag, e in ch12.EXERCISES.items()}
REFERENCES = {tag: e.reference[0] for tag, e in ch12.EXERCISES.items()}
CALLS = 3                     # fresh draws per mistake: a hint must be reached on every one of them

passes = functools.partial(course_checks.passes_by_tag, CHECKS, times=CALLS)
fails = functools.partial(course_checks.fails_by_tag, CHECKS, times=CALLS)


@pytest.mark.parametrize("tag", sorted(CHECKS))
def test_reference_passes(tag, capsys):
    passes(tag, REFERENCES[tag], capsys)


@pytest.mark.parametrize("tag", sorted(CHECKS))
def test_stub_is_not_done(tag):
    fails(tag, course_checks.stub, "not implemented yet")


# -- E12.2 incremental detokenization ----------------------------------------------------------------------------
def test_every_draw_has_split_characters_a_cut_prompt_and_metaspace_spaces():
    """The input classes the check promises, in every call."""
    for _ in range(CALLS):
        cases = ch12._detok_cases(ch12.fresh_generator())
        bpe = [c for c in cases if c[0] == "byte-level"]
        sp = [c for c in cases if c[0] == "metaspace"]
        tok = ch12.byte_level_tokenizer()
        assert any(ch12.REPLACEMENT in tok.decode([t]) for _, _, _, c, _, _ in bpe for t in c)          # byte tokens
        assert any(tok.decode(p).endswith(ch12.REPLACEMENT) for _, _, p, _, _, _ in bpe)              # cut prompt
        assert any(tok.decode(c).endswith(ch12.REPLACEMENT) for _, _, _, c, _, _ in bpe)              # cut end
        mtok = ch12.metaspace_tokenizer()
        space = mtok.convert_tokens_to_ids("▁")
        assert any(mtok.convert_ids_to_tokens(c[0]).startswith("▁") for _, _, _, c, _, _ in sp)       # leading space
        assert any(space in c for _, _, _, c, _, _ in sp)                                            # lone "▁"
        assert max(len(c) for _, _, _, c, _, _ in cases) > 30


def test_every_draw_has_each_tokenizer_family_with_and_without_special_tokens():
    """Byte-level BPE, Metaspace and Llama-2's SentencePiece decoder, each with special tokens in the stream,
    decoded with skip_special_tokens True and False."""
    for _ in range(CALLS):
        cases = ch12._detok_cases(ch12.fresh_generator())
        families = {name.split(" ")[0] for name, *_ in cases}
        assert families == {"byte-level", "metaspace", "llama"}
        for family in families:
            for skip in (True, False):
                mine = [c for c in cases if c[0].split(" ")[0] == family and c[5] is skip]
                assert mine, (family, skip)
                specials = set(mine[0][1].all_special_ids)
                assert any(specials & set(p + c) for _, _, p, c, _, _ in mine), (family, skip)
        llama = ch12.llama_tokenizer()
        byte_ids = {llama.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
        assert not any(byte_ids & set(p + c) for name, _, p, c, _, _ in cases if name.startswith("llama"))


def test_the_reference_step_is_the_engines_detokenizer_on_every_family_and_special_token_setting():
    import random
    rng = random.Random(1)
    words = ch12.WORDS
    for tok in (ch12.byte_level_tokenizer(), ch12.metaspace_tokenizer(), ch12.llama_tokenizer()):
        specials = tok.all_special_ids
        for skip in (True, False):
            for _ in range(100):
                prompt = tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 5))),
                                    add_special_tokens=False)
                comp = tok.encode(" " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 8))),
                                  add_special_tokens=False)
                for _ in range(rng.randint(0, 3)):
                    target = prompt if rng.random() < 0.5 else comp
                    target.insert(rng.randint(0, len(target)), rng.choice(specials))
                sizes = []
                while sum(sizes) < len(comp):
                    sizes.append(min(rng.choice((1, 1, 2, 3)), len(comp) - sum(sizes)))
                want = ch12._engine_pieces(tok, prompt, comp, sizes, skip)
                assert ch12._run_detok(ch12.reference_detokenize_step, tok, prompt, comp, sizes, skip=skip)[0] == want


def test_the_reference_step_is_the_engines_detokenizer_on_random_token_soup():
    import random
    rng = random.Random(0)
    for tok in (ch12.byte_level_tokenizer(), ch12.metaspace_tokenizer()):
        for _ in range(300):
            prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
            comp = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
            sizes = []
            while sum(sizes) < len(comp):
                sizes.append(min(rng.choice((1, 2, 3)), len(comp) - sum(sizes)))
            pieces, _ = ch12._run_detok(ch12.reference_detokenize_step, tok, prompt, comp, sizes)
            assert pieces == ch12._engine_pieces(tok, prompt, comp, sizes)


def test_detok_decoding_only_the_new_tokens():
    fails("E12.2", ch12._detok_no_context, "decoding only the new tokens", "decode ids[prefix:read]")


def test_detok_emitting_half_characters():
    fails("E12.2", ch12._detok_no_holdback, "emitted U+FFFD", "ends in U+FFFD")


def test_detok_final_call_holding_back():
    fails("E12.2", ch12._detok_final_ignored, "the final call held text back", "final=True")


def test_detok_window_that_never_moves():
    fails("E12.2", ch12._detok_fixed_prefix, "your decodes grew", "prefix = read")


def test_detok_window_moved_past_the_new_tokens():
    fails("E12.2", ch12._detok_prefix_to_end, "lost its leading space", "prefix = the old read")


def test_detok_character_cut_by_the_prompt_end():
    fails("E12.2", ch12._detok_len_context, "cut by the end of the prompt", "commonprefix")


def test_detok_wrong_return_shapes():
    fails("E12.2", lambda decode, ids, prefix, read, final=False: "text", "should return a tuple")
    fails("E12.2", lambda decode, ids, prefix, read, final=False: ("", read, prefix - 1 if prefix else -1),
          "0 <= prefix <= read")


# -- E12.3 server-sent events ---------------------------------------------------------------------------------------
def test_the_hand_written_events_equal_the_servers():
    import random
    rng = random.Random(1)
    for num_prompts, n in ((1, 1), (2, 3), (3, 2)):
        outputs = ch12._stream_outputs(rng, num_prompts, n)
        head = {"id": "cmpl-x", "created": 1, "model": "m"}
        for usage in (False, True):
            want = [json.loads(e[6:]) if e != "data: [DONE]\n\n" else e
                    for e in ch12.reference_completion_events(head, n, outputs, usage)]
            got = [json.loads(e[6:]) if e != "data: [DONE]\n\n" else e
                   for e in ch12.completion_events_variant(head, n, outputs, usage)]
            assert got == want


@pytest.mark.parametrize("kind, match", [
    ("cumulative", "the whole text so far"), ("empty_chunks", "empty text"), ("refinish", "finished choice got another"),
    ("sample_index", "prompt index * n + sample index"), ("usage_per_sample", "once per sample"),
    ("no_done", "[DONE]")])
def test_sse_mistakes(kind, match):
    fails("E12.3", lambda h, n, o, u, k=kind: ch12.completion_events_variant(h, n, o, u, k), match)


def test_sse_framing_and_json():
    def no_blank_line(h, n, o, u):
        return [e.rstrip("\n") + "\n" for e in ch12.reference_completion_events(h, n, o, u)]

    def not_json(h, n, o, u):
        return [e.replace("data: {", "data: {'") for e in ch12.reference_completion_events(h, n, o, u)]

    def finish_in_text_chunk(h, n, o, u):       # finish_reason glued to the last text chunk: not the spec's shape
        out = []
        for e in ch12.reference_completion_events(h, n, o, u):
            obj = None if e == "data: [DONE]\n\n" else json.loads(e[6:])
            if obj and obj["choices"] and obj["choices"][0]["finish_reason"] and out:
                prev = json.loads(out[-1][6:]) if out[-1] != "data: [DONE]\n\n" else None
                if prev and prev["choices"] and prev["choices"][0]["index"] == obj["choices"][0]["index"] \
                        and not prev["choices"][0]["finish_reason"]:
                    prev["choices"][0]["finish_reason"] = obj["choices"][0]["finish_reason"]
                    out[-1] = f"data: {json.dumps(prev)}\n\n"
                    continue
            out.append(e)
        return out

    fails("E12.3", no_blank_line, "followed by an empty line")
    fails("E12.3", not_json, "not JSON")
    fails("E12.3", lambda h, n, o, u: "data: [DONE]\n\n", "list of str")
    fails("E12.3", finish_in_text_chunk, "E12.3")


def test_sse_stop_reason_is_optional_but_checked_when_sent():
    def no_stop_reason(h, n, o, u):
        out = []
        for e in ch12.reference_completion_events(h, n, o, u):
            if e != "data: [DONE]\n\n":
                obj = json.loads(e[6:])
                for c in obj["choices"]:
                    c.pop("stop_reason", None)
                e = f"data: {json.dumps(obj)}\n\n"
            out.append(e)
        return out

    def wrong_stop_reason(h, n, o, u):
        return [e.replace('"stop_reason":7', '"stop_reason":8').replace('"stop_reason":"\\n\\n"', '"stop_reason":"x"')
                for e in ch12.reference_completion_events(h, n, o, u)]

    for _ in range(CALLS):
        ch12.check_completion_events(no_stop_reason)
    with pytest.raises(AssertionError, match="stop_reason is what ended the choice"):
        for _ in range(10):                           # a draw holds a stop reason most of the time
            ch12.check_completion_events(wrong_stop_reason)


def test_a_wrong_stop_reason_alone_is_named_as_such_every_run():
    """A student's events right but for stop_reason None in every finish chunk were blamed, run by run, on
    mistakes that change nothing on a case (the index mistake with one prompt matched it): a student report of
    2026-12-01."""
    def stop_reason_none(h, n, o, u):
        out = []
        for e in ch12.reference_completion_events(h, n, o, u):
            if e != "data: [DONE]\n\n":
                obj = json.loads(e[6:])
                for c in obj["choices"]:
                    if "stop_reason" in c:
                        c["stop_reason"] = None
                e = f"data: {json.dumps(obj)}\n\n"
            out.append(e)
        return out

    rejected = 0
    for _ in range(20):
        try:
            ch12.check_completion_events(stop_reason_none)
        except AssertionError as exc:
            text = str(exc)
            assert "stop_reason is what ended the choice" in text and "stop_reason: yours null" in text, text
            rejected += 1
    assert rejected >= 15                             # a draw holds a stop reason most of the time


# -- E12.1 admission and abort rules --------------------------------------------------------------------------------
def _pending(engine, adds, aborts, *, aborts_last=False, undo=True, skip_rest=True, catch=(ValueError, TypeError),
             stop_at_refusal=False, keyed_by_id=False):
    if not aborts_last:
        for rid in aborts:
            engine.abort_request(rid)
    refused, added = {}, []
    for group, rid, item in adds:
        if stop_at_refusal and refused:
            break
        if skip_rest and any(k is group or k == group for k in refused) or (keyed_by_id and group in refused.values()):
            continue
        try:
            engine.add_request(item.prompt_token_ids, item.sampling_params, rid)
        except catch as exc:
            if keyed_by_id:
                refused[rid] = group
            else:
                refused[group] = exc
            if undo:
                for g, r in added:
                    if g is group:
                        engine.abort_request(r)
            continue
        added.append((group, rid))
    if aborts_last:
        for rid in aborts:
            engine.abort_request(rid)
    return refused


@pytest.mark.parametrize("kwargs, match", [
    (dict(aborts_last=True), "ran after an add"), (dict(undo=False), "must be aborted again"),
    (dict(skip_rest=False), "admitted whole or not at all"), (dict(catch=Exception), "treated as a refusal"),
    (dict(stop_at_refusal=True), "must not stop the groups after it"), (dict(keyed_by_id=True), "the keys are the groups")])
def test_pending_mistakes(kwargs, match):
    fails("E12.1", functools.partial(_pending, **kwargs), match)


def test_pending_hand_written_answer_passes(capsys):
    passes("E12.1", _pending, capsys)


def test_pending_a_copy_of_the_exception_is_not_the_engines():
    def copies(engine, adds, aborts):
        return {g: type(e)(str(e)) for g, e in _pending(engine, adds, aborts).items()}
    fails("E12.1", copies, "not the exception the engine raised")


def test_pending_a_missed_abort():
    def skips_unknown(engine, adds, aborts):
        return _pending(engine, adds, [a for a in aborts if not a.startswith("gone")])
    for _ in range(10):                    # an unknown id is drawn in most calls
        try:
            ch12.check_apply_pending(skips_unknown)
        except AssertionError as exc:
            assert "never reached the engine" in str(exc)
            return
    raise AssertionError("a missed abort was never caught")


# -- the chapter's tools ----------------------------------------------------------------------------------------------
def test_online_run_times_every_request_on_the_tiny_model():
    from nanovllm_course.common import tiny_model_dir
    from nanovllm_ref import LLM
    llm = LLM(tiny_model_dir("qwen3"), device="cpu", max_model_len=256, kvcache_block_size=16, max_num_seqs=4)
    try:
        prompts = [[5 + i, 6, 7, 8] * (i + 1) for i in range(6)]
        run = ch12.online_run(llm, prompts, 5, rate=200.0)
    finally:
        llm.exit()
    assert len(run["requests"]) == 6 and all(r["output_tokens"] == 5 for r in run["requests"])
    assert all(0 < r["ttft"] <= r["e2e"] and r["tpot"] > 0 for r in run["requests"])
    assert run["steps"]["prefill"] >= 2 and run["steps"]["decode"] >= 4          # max_num_seqs 4: two waves at least
    assert run["summary"]["completed"] == 6 and run["summary"]["output_tokens"] == 30


def test_the_records_the_chapter_reads_are_committed():
    name, record = ch12.serve_record()
    assert name in ("serve_h200.json", "serve_cpu.json") and record["workload"] == "serve" and record["servers"]
    over = ch12.overhead_record()
    assert over["workload"] == "serve_overhead" and {r["model"].split()[0] for r in over["runs"]} >= {"tiny"}


def test_hold_streams_keeps_every_stream_open_so_the_fifth_client_gets_503():
    """The back-pressure demo: with --max-queued-requests 4, four long streams are admitted and held open, the
    next two are refused at once, and once all leave their aborts free everything long before max_tokens steps
    (a line reader dropped after its first line closed the connection: every stream was aborted at once and all
    six were admitted)."""
    from nanovllm_course.common import tiny_model_dir
    server = ch12.Server(tiny_model_dir("qwen3"), "--device", "cpu", "--max-model-len", "512", "--kvcache-block-size",
                         "16", "--max-num-seqs", "8", "--max-queued-requests", "4")
    try:
        body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 500, "ignore_eos": True, "stream": True}
        before = server.health()["loop"]["steps"]
        statuses = ch12.hold_streams(server.url + "/v1/completions", 6, body)
        assert [s for s, _ in statuses] == [200, 200, 200, 200, 503, 503], statuses
        assert all(line.startswith("data: {") for _, line in statuses[:4])
        assert "--max-queued-requests 4" in statuses[4][1]
        health = ch12.wait_idle(server)
        assert health["open_requests"] == 0 and health["loop"]["steps"] - before < body["max_tokens"]
    finally:
        assert server.stop() == 0


# -- issue 30: state kept between calls, and a hint of its own for each plausible mistake -------------------------
_LOG = []


def apply_pending_written(mistake=None):
    """E12.1 as a student writes it, with one mistake (None: right)."""
    def apply_pending(engine, adds, aborts, added=[], refused_so_far={}):     # noqa: B006 - the planted mistakes
        for rid in aborts:
            engine.abort_request(rid)
        refused = refused_so_far if mistake == "refused default" else {}
        refused.clear()
        mine = added if mistake == "added default" else []
        for group, rid, item in adds:
            if group in refused:
                continue
            try:
                engine.add_request(item.prompt_token_ids, item.sampling_params, rid)
            except (ValueError, TypeError) as exc:
                refused[group] = exc
                for other, orid in mine:
                    if other is group or mistake == "undo every group":
                        engine.abort_request(orid)
                continue
            mine.append((group, rid))
            if mistake == "module log":
                _LOG.append(item)
        return refused if mistake != "refused default" else dict(refused)
    return apply_pending


def test_apply_pending_written_form_passes(capsys):
    passes("E12.1", apply_pending_written(), capsys)


@pytest.mark.parametrize("mistake,says", [
    ("added default", "the default argument added=[] holds"),
    ("refused default", "keeps state between calls"),
    ("module log", "the module-level list _LOG"),
    ("undo every group", "which no refusal concerns"),
])
def test_apply_pending_keeps_no_state_and_undoes_only_the_refused_group(mistake, says):
    _LOG.clear()
    fails("E12.1", apply_pending_written(mistake), says)


def test_held_state_names_defaults_closures_and_module_containers():
    from nanovllm_course.common import held_state
    seen = []

    def f(x, acc=[], *, cache={}):                           # noqa: B006
        acc.append(x)
        cache[x] = x
        seen.append(x)
        _LOG.append(x)
    _LOG.clear()
    before = held_state(f)
    f(1)
    f(2)
    after = held_state(f)
    assert after["the default argument acc=[]"] == 2 and before["the default argument acc=[]"] == 0
    assert after["the default argument cache={}"] == 2
    assert after["the variable seen of the enclosing function"] == 2
    assert after["the module-level list _LOG"] == 2
    assert held_state(ch12.reference_apply_pending) == {}


@pytest.mark.parametrize("name", ["read_on_hold", "stripped", "fffd_inside", "context_fffd", "blank_held"])
def test_detokenize_mistakes_get_their_own_hint(name):
    message = next(m for n, m, _ in ch12.DETOK_MUTANTS if n == name)
    fails("E12.2", getattr(ch12, f"_detok_{name}"), message[:40])


def test_detokenize_step_that_caches_between_calls_is_rejected():
    def step(decode, ids, prefix, read, final=False, memo={}):       # noqa: B006 - the planted mistake
        memo[len(memo)] = tuple(ids)
        return ch12.reference_detokenize_step(decode, ids, prefix, read, final)
    fails("E12.2", step, "keeps state between calls")


@pytest.mark.parametrize("kind", ["finish_with_text", "sent_by_sample", "usage_per_output", "usage_characters"])
def test_completion_events_mistakes_get_their_own_hint(kind):
    message = next(m for k, m, _ in ch12.SSE_MUTANTS if k == kind)
    fails("E12.3", functools.partial(ch12.completion_events_variant, kind=kind), message[:40])


# -- E12.4 the front end's half of a step ---------------------------------------------------------------------------
FRONT_RUNS = 12               # fresh draws per planted mistake: its own hint in every one


def test_front_end_reference_is_the_engines_output_processor():
    """The hand-written reference and the mistake-free variant give, step by step, the OutputProcessor's state."""
    tok = ch12.byte_level_tokenizer()
    for seed in range(4):
        cases, records = ch12._front_cases(ch12.fresh_generator(seed), tok)
        for case, (steps, want) in zip(cases, records):
            assert ch12._front_replay(ch12.reference_process_outputs, case, steps, tok) == (want, None)
            assert ch12._front_replay(functools.partial(ch12.process_outputs_variant, kind=None), case, steps,
                                      tok) == (want, None)


def test_front_end_draws_hold_what_the_spec_promises():
    """Every draw has stop strings split over tokens, a stop string hidden by min_tokens, one on the core's last
    token, tokens that arrive after a sample finished, an abort in the core, and a client that leaves."""
    tok = ch12.byte_level_tokenizer()
    for seed in range(3):
        cases, records = ch12._front_cases(ch12.fresh_generator(100 + seed), tok)
        assert any(r["sp"].min_tokens > 0 for c in cases for r in c["requests"])
        assert any(tr[-1]["aborts"] or any(t["aborts"] for t in tr) for _, tr in records)
        assert any(c["client_abort"] and any(cl for cl, _ in st) for c, (st, _) in zip(cases, records))
        assert any(len(o.new_token_ids) == 2 for _, (st, _) in zip(cases, records) for _, outs in st for o in outs)


@pytest.mark.parametrize("kind", ch12.FRONT_KINDS)
def test_front_end_mistakes_get_their_own_hint(kind):
    message, hint = next((m, h) for k, m, h in ch12.FRONT_MUTANTS if k == kind)
    fails("E12.4", functools.partial(ch12.process_outputs_variant, kind=kind), message[:50], hint[:40], times=FRONT_RUNS)


def test_front_end_indexing_requests_by_id_is_caught():
    fails("E12.4", functools.partial(ch12.process_outputs_variant, kind="key_error"),
          "no longer in `requests`", "requests.get(out.request_id)", times=FRONT_RUNS)


def _front_written(requests, outputs, seen=None):
    """E12.4 as a student writes it (not the reference's shape); with `seen` a list, it keeps every output."""
    aborts = []
    for out in outputs:
        if seen is not None:
            seen.append(out)
        req = requests.get(out.request_id)
        if req is None:
            continue
        sample, sp = req.samples[out.index], req.sampling_params
        if sample.finish_reason is not None:
            continue
        stopped_by_string = False
        for j, tid in enumerate(out.new_token_ids):
            sample.token_ids.append(tid)
            if out.finish_reason == "stop" and j == len(out.new_token_ids) - 1:
                if sp.include_stop_str_in_output:
                    sample.text += sample.detokenize([tid])
                break
            new = sample.detokenize([tid])
            sample.text += new
            if len(sample.token_ids) <= sp.min_tokens:
                continue
            matches = []
            for stop in sp.stop:
                i = sample.text.find(stop, max(0, len(sample.text) - len(new) - len(stop) + 1))
                if i >= 0:
                    matches.append((i, stop))
            if matches:
                i, stop = min(matches)
                sample.text = sample.text[:i + len(stop) if sp.include_stop_str_in_output else i]
                sample.finish_reason, sample.stop_reason = "stop", stop
                if out.finish_reason is None:
                    aborts.append((out.request_id, out.index))
                stopped_by_string = True
                break
        if not stopped_by_string and out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        if all(s.finish_reason is not None for s in req.samples):
            del requests[out.request_id]
    return aborts


def test_front_end_written_form_passes(capsys):
    passes("E12.4", _front_written, capsys)


def test_front_end_that_keeps_outputs_between_calls_is_rejected():
    def keeps(requests, outputs, seen=[]):                        # noqa: B006 - the planted mistake
        return _front_written(requests, outputs, seen)
    fails("E12.4", keeps, "keeps state between calls", "the default argument seen=[]")


def test_front_end_wrong_return_type():
    fails("E12.4", lambda requests, outputs: set(ch12.reference_process_outputs(requests, outputs)),
          "should return a list of (core request id, sample index)")
