"""The serving layer's parts in one process, no HTTP: the engine loop (joins between steps, aborts, back-pressure,
engine failure, shutdown) on the fake engine, the sampling-field mapping, the length rules, the deltas, and the
adapter's check of the engine's request API."""
import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest
from serve_fake_engine import FakeCompletion, FakeEngine, FakeRequestOutput, fake_answer

from nanovllm_ref.entrypoints.openai import sampling
from nanovllm_ref.entrypoints.openai.engine_loop import Aborted, EngineDead, EngineLoop, Overloaded
from nanovllm_ref.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from nanovllm_ref.entrypoints.openai.serving import Choices, chat_inputs, completion_inputs, completion_prompts
from nanovllm_ref.entrypoints.openai.serving_engine import (LLMEngineAdapter, check_serving_engine,
                                                            default_engine_factory, engine_request_api_missing)
from nanovllm_ref import sampling_params as sampling_params_module
from nanovllm_ref.sampling_params import SamplingParams


def _input(ids, max_tokens=8, **kw):
    return SimpleNamespace(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                                **kw))


def _run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _collect(group):
    await group.admitted
    last = {}
    async for index, out in group:
        last[index] = out
    return [last[i].outputs[0].text for i in sorted(last)]


def test_requests_join_the_running_batch_between_steps(model_dir):
    engine = FakeEngine(model_dir, step_delay=0.005)
    check_serving_engine(engine)

    async def main():
        loop = EngineLoop(engine)
        await loop.start()
        first = loop.submit([_input([5, 6, 7], max_tokens=30, ignore_eos=True)])
        await first.admitted
        while engine.num_steps < 5:
            await asyncio.sleep(0.005)
        second = loop.submit([_input([8, 9], max_tokens=5)])
        texts = await asyncio.gather(_collect(first), _collect(second))
        await loop.shutdown()
        return first.request_ids[0], second.request_ids[0], texts

    a, b, texts = _run(main())
    assert texts == [[fake_answer(engine.tokenizer, [5, 6, 7], 30, ignore_eos=True)[0]],
                     [fake_answer(engine.tokenizer, [8, 9], 5)[0]]]
    batches = [e["batch"] for e in engine.calls if e["event"] == "step"]
    joined = next(i for i, batch in enumerate(batches) if b in batch)
    assert joined >= 5 and a in batches[joined] and a in batches[joined - 1] and b not in batches[joined - 1]
    assert engine.closed and engine.calls[-1] == {"event": "exit", "unfinished": []}


def test_abort_before_admission_never_reaches_the_engine_and_after_it_frees_the_request(model_dir):
    engine = FakeEngine(model_dir, step_delay=0.01)

    async def main():
        loop = EngineLoop(engine)
        await loop.start()
        early = loop.submit([_input([5, 6])])
        early.abort()                                   # still in the pending list: dropped there
        with pytest.raises(Aborted):
            await early.admitted
        late = loop.submit([_input([7, 8], max_tokens=100, ignore_eos=True)])
        await late.admitted
        await asyncio.sleep(0.05)
        late.abort()
        while not [e for e in engine.calls if e["event"] == "abort"]:
            await asyncio.sleep(0.005)
        open_after = loop.num_open
        await loop.shutdown()
        return early.request_ids[0], late.request_ids[0], open_after

    early, late, open_after = _run(main())
    added = [e["request_id"] for e in engine.calls if e["event"] == "add"]
    assert added == [late]
    assert [e for e in engine.calls if e["event"] == "abort"] == [{"event": "abort", "request_id": late, "known": True}]
    assert open_after == 0 and not engine.has_unfinished_requests()


def test_submit_beyond_the_queue_bound_is_refused_at_once_and_a_place_frees_when_one_finishes(model_dir):
    engine = FakeEngine(model_dir, step_delay=0.005)

    async def main():
        loop = EngineLoop(engine, max_queued_requests=3)
        await loop.start()
        groups = [loop.submit([_input([5, i], max_tokens=3)]) for i in range(3)]
        with pytest.raises(Overloaded, match="--max-queued-requests 3"):
            loop.submit([_input([9, 9])])
        batch = [_input([9, 1]), _input([9, 2])]
        with pytest.raises(Overloaded):
            loop.submit(batch)                          # two places wanted, none free: nothing queued
        await asyncio.gather(*(_collect(g) for g in groups))
        again = loop.submit(batch)                      # all finished: the places are free again
        texts = await _collect(again)
        await loop.shutdown()
        return texts

    assert _run(main()) == [fake_answer(engine.tokenizer, [9, 1], 8)[0], fake_answer(engine.tokenizer, [9, 2], 8)[0]]


def test_an_engine_refusal_fails_only_its_group_and_undoes_its_siblings(model_dir):
    engine = FakeEngine(model_dir)

    async def main():
        loop = EngineLoop(engine)
        await loop.start()
        bad = loop.submit([_input([5, 6]), _input([0, 0, 1])])   # the fake refuses a prompt starting 0, 0
        good = loop.submit([_input([7, 8])])
        with pytest.raises(ValueError, match="fake engine refuses"):
            await bad.admitted
        texts = await _collect(good)
        await loop.shutdown()
        return bad.request_ids, texts

    (sibling, refused), texts = _run(main())
    assert texts == [fake_answer(engine.tokenizer, [7, 8], 8)[0]]
    assert {"event": "abort", "request_id": sibling, "known": True} in engine.calls
    assert refused not in [e["request_id"] for e in engine.calls if e["event"] == "add"]


def test_a_failing_engine_fails_every_open_request_and_then_refuses_new_ones(model_dir):
    engine = FakeEngine(model_dir, fail_at_step=3)

    async def main():
        loop = EngineLoop(engine)
        await loop.start()
        group = loop.submit([_input([5, 6], max_tokens=50, ignore_eos=True)])
        with pytest.raises(EngineDead, match="failed on purpose"):
            await _collect(group)
        with pytest.raises(EngineDead):
            loop.submit([_input([5, 6])])
        dead = str(loop.dead)
        await loop.shutdown()
        return dead

    assert "RuntimeError" in _run(main())
    assert engine.closed


def test_shutdown_aborts_open_requests_then_calls_exit(model_dir):
    engine = FakeEngine(model_dir, step_delay=0.01)

    async def main():
        loop = EngineLoop(engine)
        await loop.start()
        group = loop.submit([_input([5, 6], max_tokens=100, ignore_eos=True)])
        await group.admitted
        await asyncio.sleep(0.05)
        await loop.shutdown()
        with pytest.raises(Aborted):
            await _collect(group)
        with pytest.raises(EngineDead, match="shutting down"):
            loop.submit([_input([5, 6])])
        return group.request_ids[0]

    rid = _run(main())
    kinds = [(e["event"], e.get("request_id")) for e in engine.calls if e["event"] in ("abort", "exit")]
    assert kinds == [("abort", rid), ("exit", None)]
    assert engine.calls[-1]["unfinished"] == []


def test_max_queued_requests_is_checked():
    with pytest.raises(ValueError, match="max_queued_requests"):
        EngineLoop(object(), max_queued_requests=0)


# -- deltas --------------------------------------------------------------------------------------------------
def _out(rid, text, ids, finish=None, index=0):
    return FakeRequestOutput(rid, None, [1], [FakeCompletion(index, text, ids, finish)], finish is not None)


def test_choices_stream_the_differences_of_cumulative_text():
    choices = Choices([3, 4], n=1)
    assert [(d.index, d.text) for d in choices.update(0, _out("a", "He", [1]))] == [(0, "He")]
    assert choices.update(0, _out("a", "He", [1, 2])) == []          # new token, text held back
    assert [(d.index, d.text) for d in choices.update(1, _out("b", "Yo", [5]))] == [(1, "Yo")]
    delta = choices.update(0, _out("a", "Hello", [1, 2, 3], "stop"))[0]
    assert (delta.index, delta.text, delta.finish_reason) == (0, "llo", "stop")
    assert not choices.finished
    choices.update(1, _out("b", "Yo!", [5, 6], "length"))
    assert choices.finished
    assert choices.usage().model_dump() == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert [(i, c.text) for i, c in choices.final()] == [(0, "Hello"), (1, "Yo!")]


def test_choices_refuse_text_that_does_not_extend_what_was_sent():
    choices = Choices([3], n=1)
    choices.update(0, _out("a", "caf\ufffd", [1]))
    with pytest.raises(RuntimeError, match="only append"):
        choices.update(0, _out("a", "café", [1, 2]))


# -- the sampling mapping, the engine's refusals named by field, and the length rules ---------------------------
def test_sampling_kwargs_pass_what_is_asked_and_refuse_what_the_server_cannot_serve():
    req = CompletionRequest(prompt="x", temperature=0.5, top_k=4, n=1, presence_penalty=0.0, stop=[], min_p=0.2)
    assert sampling.sampling_kwargs(req) == {"temperature": 0.5, "top_k": 4, "min_p": 0.2}
    with pytest.raises(APIError) as info:
        sampling.sampling_kwargs(CompletionRequest(prompt="x", best_of=2))
    assert info.value.param == "best_of" and info.value.status == 400


@pytest.mark.parametrize("best_of,n", [(1, 2), (2, 3), (0, None)])
def test_best_of_below_n_is_refused_by_name(best_of, n):
    """OpenAI and vLLM refuse best_of < n (n samples cannot come from fewer); best_of=1 with n=2 was taken as
    the neutral best_of=1 and answered with two choices (a reviewer's probe)."""
    with pytest.raises(APIError) as info:
        sampling.sampling_kwargs(CompletionRequest(prompt="x", best_of=best_of, n=n))
    assert info.value.param == "best_of" and info.value.status == 400
    assert "best_of must be at least n" in info.value.message and f"n={n or 1}" in info.value.message
    assert sampling.sampling_kwargs(CompletionRequest(prompt="x", best_of=1, n=1)) == {}


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("request_,logprobs", [
    (CompletionRequest(prompt="x", logprobs=0), 0), (CompletionRequest(prompt="x", logprobs=3), 3),
    (CompletionRequest(prompt="x"), None),
    (ChatCompletionRequest(messages=CHAT, logprobs=True), 0), (ChatCompletionRequest(messages=CHAT, logprobs=False), None),
    (ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=5), 5), (ChatCompletionRequest(messages=CHAT), None)])
def test_logprobs_map_to_sampling_params_logprobs(request_, logprobs):
    """Completions' logprobs is the number of top tokens; chat's logprobs turns them on and top_logprobs counts."""
    assert sampling.sampling_kwargs(request_).get("logprobs") == logprobs


def test_chat_top_logprobs_without_logprobs_is_refused_by_name():
    for logprobs in (None, False):
        with pytest.raises(APIError) as info:
            sampling.sampling_kwargs(ChatCompletionRequest(messages=CHAT, logprobs=logprobs, top_logprobs=2))
        assert info.value.param == "top_logprobs" and "logprobs: true" in info.value.message


def _engine_with_the_real_check(**config):
    from nanovllm_ref.engine.request import check_request
    from nanovllm_ref.engine.scheduler import Scheduler
    config = SimpleNamespace(**{**dict(hf_config=SimpleNamespace(vocab_size=100), max_num_seqs=4, max_model_len=64,
                                       kvcache_block_size=16, num_kvcache_blocks=8), **config})
    return SimpleNamespace(check_request=lambda ids, sp, where="prompt": check_request(
        ids, sp, tokenizer=None, config=config, scheduler_cls=Scheduler, where=where, sp_where="the request"))


COMPLETION, CHAT_REQUEST = CompletionRequest(prompt="x"), ChatCompletionRequest(messages=CHAT)
CHAT_NEW_NAMES = ChatCompletionRequest(messages=CHAT, max_completion_tokens=4, logprobs=True, top_logprobs=1)
REFUSALS = [   # (request, prompt ids, SamplingParams kwargs, the param its 400 must name, words of the message)
    (COMPLETION, [1, 2], {"n": 5}, "n", "max_num_seqs"),
    (COMPLETION, [1, 2], {"stop_token_ids": [100]}, "stop_token_ids", "outside the vocabulary"),
    (COMPLETION, [1, 200], {}, "prompt", "outside [0, 100)"),
    (CHAT_REQUEST, [1, 200], {}, "messages", "outside [0, 100)"),
    (COMPLETION, [], {}, "prompt", "is empty"),
    (COMPLETION, [1] * 129, {"max_tokens": 1}, "prompt", "its 129 tokens need 9 blocks"),
    (COMPLETION, [1] * 10, {"max_tokens": 130}, "max_tokens", "at most 119"),   # 8 blocks of 16: 128 slots
    (CHAT_REQUEST, [1] * 10, {"logprobs": 21}, "logprobs", "more than 20"),
    (CHAT_NEW_NAMES, [1] * 10, {"logprobs": 21}, "top_logprobs", "more than 20"),
]


@pytest.mark.parametrize("request_,ids,kwargs,param,says", REFUSALS, ids=[r[3] + str(i) for i, r in enumerate(REFUSALS)])
def test_the_engines_refusal_names_the_request_field_from_its_request_error(request_, ids, kwargs, param, says):
    """The engine's own check decides (check_with_engine), and the RequestError's field, mapped to the request's
    own field (sampling.request_param), is the param; the message is the engine's."""
    engine = _engine_with_the_real_check(max_model_len=200)
    with pytest.raises(APIError) as info:
        sampling.check_with_engine(engine, request_, ids, SamplingParams(**{"max_tokens": 4, **kwargs}), "prompt")
    assert info.value.param == param and says in info.value.message, info.value.message


def test_max_tokens_names_the_field_the_request_set():
    engine = _engine_with_the_real_check(max_model_len=200)
    with pytest.raises(APIError) as info:
        sampling.check_with_engine(engine, CHAT_NEW_NAMES, [1] * 10, SamplingParams(max_tokens=150), "messages")
    assert info.value.param == "max_completion_tokens" and "at most 119" in info.value.message
    sampling.check_with_engine(engine, CHAT_NEW_NAMES, [1] * 10, SamplingParams(max_tokens=119), "messages")


def test_an_engine_refusal_without_a_field_names_none_whatever_its_text_says(monkeypatch):
    """No error text is read: a plain ValueError that mentions a field is a 400 with param None."""
    def check(ids, sp, where="prompt"):
        raise ValueError("SamplingParams.min_p=0.2 is not implemented yet; max_tokens too large")
    with pytest.raises(APIError) as info:
        sampling.check_with_engine(SimpleNamespace(check_request=check), COMPLETION, [1, 2], SamplingParams(), "prompt")
    assert info.value.param is None and "min_p" in info.value.message
    sampling.check_with_engine(SimpleNamespace(), COMPLETION, [1, 2], SamplingParams(), "prompt")   # no check: add decides


def test_a_pending_field_is_refused_by_the_engines_check_while_pending_lists_it(monkeypatch):
    engine = _engine_with_the_real_check()
    sp = SamplingParams(min_p=0.2, max_tokens=4)
    monkeypatch.setattr(sampling_params_module, "PENDING", {"min_p": 0.0})
    with pytest.raises(APIError) as info:
        sampling.check_with_engine(engine, COMPLETION, [1, 2], sp, "prompt")
    assert info.value.param == "min_p" and "not implemented yet" in info.value.message
    monkeypatch.setattr(sampling_params_module, "PENDING", {})
    sampling.check_with_engine(engine, COMPLETION, [1, 2], sp, "prompt")


@pytest.mark.parametrize("request_,kwargs,max_tokens,param", [
    (COMPLETION, {"temperature": -1.0}, 5, "temperature"), (COMPLETION, {"top_p": 0.0}, 5, "top_p"),
    (COMPLETION, {}, 0, "max_tokens"), (COMPLETION, {"top_k": -3}, 5, "top_k"),
    (COMPLETION, {"stop_token_ids": [3, -1]}, 5, "stop_token_ids"), (COMPLETION, {"min_tokens": 9}, 5, "min_tokens"),
    (COMPLETION, {"logprobs": -1}, 5, "logprobs"), (CHAT_NEW_NAMES, {"logprobs": -1}, 5, "top_logprobs"),
    (CHAT_NEW_NAMES, {}, 0, "max_completion_tokens"), (CHAT_REQUEST, {}, 0, "max_tokens")])
def test_sampling_params_errors_name_the_request_field(request_, kwargs, max_tokens, param):
    with pytest.raises(APIError) as info:
        sampling.make_sampling_params(request_, kwargs, max_tokens)
    assert info.value.param == param


def test_chat_max_completion_tokens_is_named_in_its_errors(model_dir):
    engine = FakeEngine(model_dir)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=10**5)
    with pytest.raises(APIError) as info:
        chat_inputs(req, engine)
    assert info.value.param == "max_completion_tokens"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}],
                                max_tokens=3, max_completion_tokens=4)
    (one,) = chat_inputs(req, engine)
    assert one.sampling_params.max_tokens == 4                  # the newer name wins, as in vLLM
    from nanovllm_ref.llm import chat_token_ids
    assert one.prompt_token_ids == chat_token_ids(engine.tokenizer, [{"role": "user", "content": "a\nb"}])


def test_max_tokens_left_out_is_the_most_the_engines_check_accepts():
    """One KV-cache rule: for every prompt length and cache size, max_tokens=None resolves to exactly the most
    the engine's check_request accepts (capped by max_model_len), and that check refuses exactly the requests
    whose blocks (counted here, block by block) outnumber the cache's."""
    from nanovllm_ref.engine.request import check_request
    from nanovllm_ref.engine.scheduler import Scheduler
    from nanovllm_ref.errors import RequestError
    max_len = 48
    for block_size in (1, 4, 16):
        for num_blocks in (1, 3, 4, 8):
            config = SimpleNamespace(hf_config=SimpleNamespace(vocab_size=100), max_num_seqs=4, max_model_len=max_len,
                                     kvcache_block_size=block_size, num_kvcache_blocks=num_blocks)

            def accepts(prompt_len, max_tokens):
                try:
                    check_request([1] * prompt_len, SamplingParams(max_tokens=max_tokens), tokenizer=None,
                                  config=config, scheduler_cls=Scheduler)
                    return True
                except RequestError as exc:
                    assert exc.field == ("prompt" if prompt_len > num_blocks * block_size else "max_tokens")
                    return False
            for prompt_len in range(1, max_len):
                for max_tokens in range(1, max_len - prompt_len + 1):
                    longest = max(prompt_len, min(prompt_len + max_tokens, max_len) - 1)
                    blocks = sum(1 for start in range(0, longest, block_size))
                    assert accepts(prompt_len, max_tokens) == (blocks <= num_blocks), (block_size, num_blocks,
                                                                                       prompt_len, max_tokens)
                resolved = sampling.resolve_max_tokens(None, prompt_len, max_len, num_blocks * block_size)
                if accepts(prompt_len, 1):
                    assert accepts(prompt_len, resolved), (block_size, num_blocks, prompt_len, resolved)
                    assert resolved == max_len - prompt_len or not accepts(prompt_len, resolved + 1)
                else:
                    assert resolved == 1                 # the prompt alone does not fit: the check refuses it


def test_max_tokens_left_out_takes_what_the_context_and_cache_leave():
    assert sampling.resolve_max_tokens(None, 10, 100) == 90
    assert sampling.resolve_max_tokens(None, 10, 100, kv_cache_tokens=50) == 41
    assert sampling.resolve_max_tokens(7, 10, 100) == 7
    with pytest.raises(APIError) as info:
        sampling.resolve_max_tokens(91, 10, 100)
    assert info.value.param == "max_tokens" and "at most 90" in info.value.message
    with pytest.raises(APIError) as info:
        sampling.resolve_max_tokens(None, 100, 100, prompt_field="messages")
    assert info.value.param == "messages"


def test_a_batch_prompt_that_leaves_no_room_is_named_by_its_index(model_dir):
    """Reported: a batch's second prompt over the context was called "the prompt"."""
    engine = FakeEngine(model_dir)                               # max_model_len 256
    with pytest.raises(APIError) as info:
        completion_inputs(CompletionRequest(prompt=[[5, 6], [5] * 200], max_tokens=100), engine)
    assert info.value.param == "max_tokens" and "prompt[1] has 200 and max_tokens=100" in info.value.message
    with pytest.raises(APIError) as info:
        completion_inputs(CompletionRequest(prompt=[[5, 6], [5] * 256], max_tokens=1), engine)
    assert info.value.param == "prompt" and "prompt[1] has 256: no room" in info.value.message


def test_completion_inputs_encode_text_prompts_with_the_tokenizer(model_dir):
    engine = FakeEngine(model_dir)
    (one,) = completion_inputs(CompletionRequest(prompt="Hello world", max_tokens=3, temperature=0), engine)
    assert one.prompt_token_ids == engine.tokenizer.encode("Hello world")
    assert (one.sampling_params.max_tokens, one.sampling_params.temperature) == (3, 0.0)


DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 5, "repetition_penalty": 1.1}


@pytest.mark.parametrize("make", [lambda **f: CompletionRequest(prompt="Hello world", **f),
                                  lambda **f: ChatCompletionRequest(messages=CHAT, **f)], ids=["completions", "chat"])
def test_omitted_fields_take_the_models_defaults_and_given_ones_win(model_dir, make):
    """vLLM's --generation-config auto: the engine's sampling_defaults fill what a request leaves out; a value
    it gives wins, the neutral one too (temperature 1, top_k 0, repetition_penalty 1)."""
    engine = FakeEngine(model_dir, sampling_defaults=DEFAULTS)
    (sp,) = [i.sampling_params for i in (chat_inputs if "Chat" in type(make()).__name__ else completion_inputs)(
        make(), engine)]
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens, sp.repetition_penalty) == (0.6, 20, 0.95, 5, 1.1)
    given = make(temperature=1.0, top_k=0, repetition_penalty=1.0, max_tokens=9, min_p=0.1)
    (sp,) = [i.sampling_params for i in (chat_inputs if "Chat" in type(given).__name__ else completion_inputs)(
        given, engine)]
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens, sp.repetition_penalty, sp.min_p) == (
        1.0, 0, 0.95, 9, 1.0, 0.1)


def test_without_defaults_omitted_fields_stay_the_sampling_params_defaults(model_dir):
    engine = FakeEngine(model_dir)
    (one,) = completion_inputs(CompletionRequest(prompt="Hello world"), engine)
    assert (one.sampling_params.temperature, one.sampling_params.top_k, one.sampling_params.top_p) == (1.0, 0, 1.0)
    assert one.sampling_params.max_tokens == 16                                     # OpenAI's completions default
    (one,) = chat_inputs(ChatCompletionRequest(messages=CHAT), engine)
    assert one.sampling_params.max_tokens == 256 - len(one.prompt_token_ids)      # chat: the rest of the context


def test_the_models_max_new_tokens_caps_what_a_request_leaves_out(model_dir):
    """Completions left out is OpenAI's 16, chat's the rest of the context; the file's max_new_tokens caps
    both (vLLM's min), and a given value is kept."""
    def max_tokens(request, cap):
        inputs = (chat_inputs if isinstance(request, ChatCompletionRequest) else completion_inputs)(
            request, FakeEngine(model_dir, sampling_defaults={"max_tokens": cap}))
        return inputs[0].sampling_params.max_tokens
    assert [max_tokens(CompletionRequest(prompt="Hi"), cap) for cap in (5, 40)] == [5, 16]
    chat_len = len(chat_inputs(ChatCompletionRequest(messages=CHAT), FakeEngine(model_dir))[0].prompt_token_ids)
    assert [max_tokens(ChatCompletionRequest(messages=CHAT), cap) for cap in (5, 40, 10**6)] == [5, 40, 256 - chat_len]
    assert max_tokens(CompletionRequest(prompt="Hi", max_tokens=30), 5) == 30
    assert max_tokens(ChatCompletionRequest(messages=CHAT, max_completion_tokens=30), 5) == 30


def test_the_default_max_tokens_caps_only_an_omitted_max_tokens():
    assert sampling.resolve_max_tokens(None, 10, 100, default=5) == 5
    assert sampling.resolve_max_tokens(None, 10, 100, default=500) == 90        # the context still bounds it
    assert sampling.resolve_max_tokens(None, 10, 100, kv_cache_tokens=50, default=60) == 41
    assert sampling.resolve_max_tokens(30, 10, 100, default=5) == 30            # a given max_tokens is kept


def test_a_refusal_caused_by_a_default_says_it_came_from_the_generation_config(model_dir):
    """The request set no max_tokens, so "min_tokens must be in [0, 7]" alone would puzzle; a field it gave is
    named as before."""
    engine = FakeEngine(model_dir, sampling_defaults={"max_tokens": 7})
    with pytest.raises(APIError) as err:
        chat_inputs(ChatCompletionRequest(messages=CHAT, min_tokens=10), engine)
    assert err.value.param == "min_tokens"
    assert "max_tokens=7 is the model's default, from its generation config, as the request left max_tokens out" \
        in str(err.value)
    with pytest.raises(APIError) as err:
        chat_inputs(ChatCompletionRequest(messages=CHAT, min_tokens=10, max_tokens=8), engine)
    assert "generation config" not in str(err.value)


def test_serve_takes_vllms_generation_config_flags():
    import argparse

    from nanovllm_ref.entrypoints import cli_args
    p = argparse.ArgumentParser()
    cli_args.add_serve_flags(p)
    args = p.parse_args(["--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}'])
    assert {k: v for k, v in cli_args.more_engine_args(args).items() if "generation" in k} == {
        "generation_config": "vllm", "override_generation_config": {"temperature": 0.5}}
    assert cli_args.more_engine_args(p.parse_args([]))["generation_config"] == "auto"   # the engine's default
    assert "override_generation_config" not in cli_args.more_engine_args(p.parse_args([]))


@pytest.mark.parametrize("value", ["[1]", "{not json", '"temperature"'])
def test_an_override_generation_config_that_is_not_a_json_object_is_refused_by_name(value, capsys):
    from nanovllm_ref.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "unused", "--override-generation-config", value])
    assert exit_.value.code == 2
    assert "argument --override-generation-config: --override-generation-config must be a JSON object" in \
        capsys.readouterr().err


# -- the adapter ----------------------------------------------------------------------------------------------
class _NewAPIEngine:
    """An LLMEngine stand-in with the request API the adapter forwards to."""
    def __init__(self):
        self.tokenizer = object()
        self.config = SimpleNamespace(max_model_len=64, hf_config=SimpleNamespace(vocab_size=100),
                                      num_kvcache_blocks=3, kvcache_block_size=16)
        self.scheduler = SimpleNamespace(running=["s"], waiting=[], block_manager=SimpleNamespace(num_free_blocks=2))
        self.log = []

    def add_request(self, prompt, sampling_params=None, request_id=None):
        self.log.append(("add", prompt, request_id))
        return request_id

    def abort_request(self, request_id):
        self.log.append(("abort", request_id))

    def step(self):
        return ["out"]

    def is_finished(self):
        return False

    def exit(self):
        self.log.append(("exit",))


def test_adapter_forwards_to_the_engines_request_api():
    engine = _NewAPIEngine()
    adapter = LLMEngineAdapter(engine)
    check_serving_engine(adapter)
    assert (adapter.max_model_len, adapter.vocab_size, adapter.kv_cache_tokens) == (64, 100, 48)
    assert adapter.add_request([1, 2], None, "r1") == "r1"
    adapter.abort_request("r1")
    assert adapter.step() == ["out"] and adapter.has_unfinished_requests()
    assert adapter.stats() == {"running": 1, "waiting": 0, "kv_blocks_free": 2, "kv_blocks_total": 3}
    adapter.exit()
    assert engine.log == [("add", [1, 2], "r1"), ("abort", "r1"), ("exit",)]


def test_adapter_refuses_an_engine_without_the_request_api_and_the_factory_builds_the_real_one(tmp_path):
    class Old:
        def add_request(self, prompt, sampling_params): ...
        def step(self): ...
        def is_finished(self): ...
        def exit(self): ...
    assert engine_request_api_missing(Old) == ["abort_request", "add_request(..., request_id=)"]
    with pytest.raises(TypeError, match="abort_request"):
        LLMEngineAdapter(Old())
    from nanovllm_ref.engine.llm_engine import LLMEngine
    assert engine_request_api_missing(LLMEngine) == []
    from nanovllm_models.tiny import make_tiny_model
    adapter = default_engine_factory(make_tiny_model(str(tmp_path / "tiny")), max_model_len=128, device="cpu",
                                     override_generation_config={"top_k": 7})
    try:
        check_serving_engine(adapter)
        assert adapter.max_model_len == 128
        assert adapter.sampling_defaults == {"top_k": 7}       # the engine's config's, for the server's requests
        with pytest.raises(ValueError, match="max_num_seqs"):
            adapter.check_request([1, 2], SamplingParams(n=10**4))
    finally:
        adapter.exit()


@pytest.mark.parametrize("text", ["plain", ' "quoted" \\ back\\slash', "line\nbreak\ttab", "café ☕ 日本", "\x00\x1f", ""])
def test_stream_text_chunks_equal_the_pydantic_chunks(text):
    from nanovllm_ref.entrypoints.openai.api_server import _TextChunk
    from nanovllm_ref.entrypoints.openai.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice,
                                                          CompletionResponse, DeltaMessage)
    head = dict(id="cmpl-x", model="m", created=123)
    template = _TextChunk(lambda i, t: CompletionResponse(**head, choices=[CompletionChoice(index=i, text=t)]))
    line = template(3, text)
    assert line.startswith("data: ") and line.endswith("\n\n")
    want = CompletionResponse(**head, choices=[CompletionChoice(index=3, text=text)]).model_dump()
    assert json.loads(line[6:]) == want
    template = _TextChunk(lambda i, t: ChatCompletionChunk(**head, choices=[ChatChunkChoice(
        index=i, delta=DeltaMessage(content=t))]))
    want = ChatCompletionChunk(**head, choices=[ChatChunkChoice(index=0, delta=DeltaMessage(content=text))])
    assert json.loads(template(0, text)[6:]) == want.model_dump()


# -- which field an error names: chosen by which input was being checked, never from the error's text ----------
RAISING_TEMPLATE = "{{ raise_exception('this template wants a system message first') }}"


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])
def test_a_chat_template_failure_names_messages_whatever_its_text_says(model_dir, kwargs):
    engine = FakeEngine(model_dir)
    engine.tokenizer.chat_template = RAISING_TEMPLATE
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs)
    with pytest.raises(APIError) as info:
        chat_inputs(request, engine)
    assert info.value.param == "messages" and "wants a system message first" in info.value.message
    # The advice names what the request sent: chat_template_kwargs only when it was given.
    assert ("chat_template_kwargs" in info.value.message) == bool(kwargs), info.value.message


def test_a_model_without_a_chat_template_points_to_completions(model_dir):
    engine = FakeEngine(model_dir)
    engine.tokenizer.chat_template = None
    with pytest.raises(APIError) as info:
        chat_inputs(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), engine)
    assert info.value.param == "messages" and "/v1/completions" in info.value.message
    assert "generate()" not in info.value.message                  # the offline advice means nothing to a client


def test_chat_template_kwargs_errors_name_it_and_give_http_advice(model_dir):
    engine = FakeEngine(model_dir)
    for kwargs, says in (({"tokenize": False}, "may not set ['tokenize']"),
                         # HF passes messages= to the template itself: it was a TypeError blamed on `messages`
                         ({"messages": []}, "may not set ['messages']"),
                         ({"persona": "\udfff"}, "chat_template_kwargs.persona is not valid text")):
        with pytest.raises(APIError) as info:
            chat_inputs(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                              chat_template_kwargs=kwargs), engine)
        assert info.value.param == "chat_template_kwargs" and says in info.value.message, info.value.message
        assert "chat()" not in info.value.message


def test_completion_prompts_that_cannot_be_tokenized_name_the_prompt(model_dir):
    engine = FakeEngine(model_dir)
    for prompt, where in (("\ud800", "prompt is"), (["ok", "x\udbff"], "prompt[1] is")):
        with pytest.raises(APIError) as info:
            completion_inputs(CompletionRequest(prompt=prompt, max_tokens=2), engine)
        assert info.value.param == "prompt" and info.value.message.startswith(f"{where} not valid text")

    class Failing:                                     # any other failure of the tokenizer is the text's fault too
        def encode(self, text):
            raise RuntimeError("the tokenizer broke on this")
    with pytest.raises(APIError) as info:
        completion_prompts("fine", Failing())
    assert info.value.param == "prompt"
    assert info.value.message == "prompt could not be tokenized (RuntimeError: the tokenizer broke on this)"


def test_stream_options_need_stream_true(model_dir):
    engine = FakeEngine(model_dir)
    with pytest.raises(APIError) as info:
        completion_inputs(CompletionRequest(prompt="hi", stream_options={"include_usage": True}), engine)
    assert info.value.param == "stream_options" and "stream is true" in info.value.message
    (one,) = completion_inputs(CompletionRequest(prompt="hi", max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}), engine)
    assert one.sampling_params.max_tokens == 2


# -- stream chunks ----------------------------------------------------------------------------------------------
ODD_HEADS = [dict(id="cmpl-987654321", model="987654321", created=987654321),
             dict(id="cmpl-@@text@@", model='"@@text@@"', created=1),
             dict(id="x", model='m 987654321 "@@text0@@" 987654322 @@text@@ "@@text1@@"', created=1987654321),
             dict(id="cmpl-x", model="caf\u00e9 \u2615", created=123)]


@pytest.mark.parametrize("head", ODD_HEADS, ids=range(len(ODD_HEADS)))
def test_stream_text_chunks_are_right_for_any_model_name_id_and_time(head):
    """A served model name (or an id, or a creation time) holding the marks the template is cut at."""
    from nanovllm_ref.entrypoints.openai.api_server import _TextChunk
    from nanovllm_ref.entrypoints.openai.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice,
                                                          CompletionResponse, DeltaMessage)
    completion = _TextChunk(lambda i, t: CompletionResponse(**head, choices=[CompletionChoice(index=i, text=t)]))
    chat = _TextChunk(lambda i, t: ChatCompletionChunk(**head, choices=[ChatChunkChoice(
        index=i, delta=DeltaMessage(content=t))]))
    for index, text in ((0, " word"), (7, '987654321 "@@text@@"')):
        want = CompletionResponse(**head, choices=[CompletionChoice(index=index, text=text)])
        assert json.loads(completion(index, text)[6:]) == want.model_dump()
        want = ChatCompletionChunk(**head, choices=[ChatChunkChoice(index=index, delta=DeltaMessage(content=text))])
        assert json.loads(chat(index, text)[6:]) == want.model_dump()


def test_a_stream_whose_engine_dies_ends_every_choice_then_says_why(model_dir):
    from nanovllm_ref.entrypoints.openai.api_server import _completion_stream

    async def main():
        loop = EngineLoop(FakeEngine(model_dir, fail_at_step=3))
        await loop.start()
        group = loop.submit([_input([5, 6], max_tokens=50, ignore_eos=True, n=2)])
        await group.admitted
        watcher = asyncio.create_task(asyncio.sleep(3600))
        head = dict(id="cmpl-x", model="m", created=1)
        lines = [line async for line in _completion_stream(group, watcher, Choices([2], 2), head, False)]
        await loop.shutdown()
        return lines

    lines = _run(main())
    assert lines[-1] == "data: [DONE]\n\n"
    error = json.loads(lines[-2][6:])["error"]
    assert "fake engine failed on purpose" in error["message"] and error["type"] == "service_unavailable"
    chunks = [json.loads(line[6:])["choices"][0] for line in lines[:-2]]
    assert {c["index"]: c["finish_reason"] for c in chunks if c["finish_reason"]} == {0: "abort", 1: "abort"}


def test_an_unexpected_server_fault_is_a_500_in_openai_shape_and_the_server_goes_on(model_dir):
    from fastapi.testclient import TestClient

    from nanovllm_ref.entrypoints.openai.api_server import build_app

    class Broken(FakeEngine):
        def check_request(self, prompt_token_ids, sampling_params, where="prompt"):
            if prompt_token_ids[:1] == [9]:
                raise RuntimeError("a bug, not the client's fault")

    app = build_app(EngineLoop(Broken(model_dir)), "m")
    with TestClient(app, raise_server_exceptions=False) as client:
        res = client.post("/v1/completions", json={"prompt": [9, 9], "max_tokens": 2})
        assert res.status_code == 500
        assert res.json() == {"error": {"message": "the server failed on this request (RuntimeError); see its log",
                                        "type": "internal_server_error", "param": None, "code": None}}
        res = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 2


# -- logprobs in OpenAI's shapes --------------------------------------------------------------------------------
def _lp(logprob, rank, text):
    from nanovllm_ref.outputs import Logprob
    return Logprob(logprob, rank, text)


# Two tokens, k = 2: the first is the most likely (2 entries), the second is not among the top 2 (3 entries, first);
# one top token's logprob is -inf (JSON has no infinity: -9999, as OpenAI and vLLM send it).
DICTS = [{7: _lp(-0.1, 1, " a"), 9: _lp(-2.5, 2, " b")},
         {4: _lp(-3.0, 3, "é"), 7: _lp(-0.2, 1, " a"), 8: _lp(float("-inf"), 2, None)}]


class _Decoder:
    """A tokenizer with no vocabulary to read bytes from (engine/token_bytes.py then decodes each token alone)."""
    def decode(self, ids):
        return {7: " a", 9: " b", 4: "é", 8: "<s>"}[ids[0]]


def test_completion_logprobs_have_openais_legacy_shape():
    from nanovllm_ref.entrypoints.openai.serving import TextOffsets, completion_logprobs
    offsets = TextOffsets()
    offsets.take(b"12345")                      # a stream's earlier chunks: 5 characters
    out = completion_logprobs([7, 4], DICTS, _Decoder(), offsets).model_dump()
    assert out == {"tokens": [" a", "é"], "token_logprobs": [-0.1, -3.0],
                   "top_logprobs": [{" a": -0.1, " b": -2.5}, {"é": -3.0, " a": -0.2, "<s>": -9999.0}],
                   "text_offset": [5, 7]}


def test_chat_logprobs_list_the_k_most_likely_by_rank():
    from nanovllm_ref.entrypoints.openai.serving import chat_logprobs
    content = chat_logprobs([7, 4], DICTS, 2, _Decoder()).model_dump()["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [(" a", -0.1, [32, 97]),
                                                                           ("é", -3.0, [0xC3, 0xA9])]
    assert [[(t["token"], t["logprob"]) for t in c["top_logprobs"]] for c in content] == [
        [(" a", -0.1), (" b", -2.5)], [(" a", -0.2), ("<s>", -9999.0)]]      # not the token itself: it is 3rd
    assert [c["top_logprobs"] for c in chat_logprobs([7], [{7: _lp(-0.1, 1, " a")}], 0, _Decoder()).model_dump()[
        "content"]] == [[]]                                                   # top_logprobs 0: the token alone


def test_streamed_deltas_carry_each_tokens_logprobs_once():
    """A token whose text is held back (a stop string may follow) has its logprobs sent with the next delta that
    has text, or with the finishing one: the deltas joined equal the whole completion's."""
    def out(text, ids, finish=None):
        lps = [{t: _lp(-0.5 - t, 1, str(t))} for t in ids]
        return FakeRequestOutput("a", None, [1], [FakeCompletion(0, text, ids, finish, None, lps)], finish is not None)
    choices = Choices([1], n=1)
    steps = [out("x", [1]), out("x", [1, 2]), out("xyz", [1, 2, 3]), out("xyz", [1, 2, 3, 4], "stop")]
    deltas = [d for step in steps for d in choices.update(0, step)]
    assert [(d.text, d.token_ids, d.finish_reason) for d in deltas] == [("x", [1], None), ("yz", [2, 3], None),
                                                                      ("", [4], "stop")]
    assert [lp for d in deltas for lp in d.logprobs] == steps[-1].outputs[0].logprobs
    assert choices.final()[0][1].logprobs == steps[-1].outputs[0].logprobs
