"""The audit of every field the server accepts: each one reaches the engine or the chat template with the meaning
OpenAI (or vLLM, for its extras) gives it, or is refused with a 400 that names it. Never accepted and dropped.

FIELDS has one row per field of every request model (protocol.py's CompletionRequest and ChatCompletionRequest
and the models nested in them: ChatMessage, TextPart, StreamOptions), found by walking the pydantic models, so
a field added without a row fails `test_every_request_field_has_a_row`. Each row sends a request that sets the
field away from its default to a real server (the fake engine, which records the SamplingParams and prompt
ids it gets) and checks where it went: the SamplingParams field and value, the rendered prompt (HF's
apply_chat_template is the oracle, with a chat template that reads a message's `name` and a `persona`
template variable), the answer's shape, or the 400.
"""
import itertools
import json
import typing

import httpx
import pytest
from pydantic import BaseModel
from serve_helpers import ServerProcess, make_tokenizer_dir

from nanovllm_ref.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

# A template that reads what OpenAI's messages may carry beyond role and content: vLLM passes `name` through.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m['name'] %} ({{ m['name'] }}){% endif %}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if persona %}<|im_start|>system\nSpeak as a {{ persona }}.<|im_end|>\n{% endif %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer
    path = make_tokenizer_dir(tmp_path_factory.mktemp("fields_tok"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    with ServerProcess(tmp_path_factory.mktemp("fields"), model_dir, {"max_num_seqs": 8},
                       args=["--served-model-name", "fake"]) as srv:
        yield srv


def request_models(*roots) -> dict[str, type[BaseModel]]:
    """Every pydantic model reachable from `roots` through field annotations (lists, unions, ...)."""
    found, todo = {}, list(roots)
    while todo:
        model = todo.pop()
        if model.__name__ in found:
            continue
        found[model.__name__] = model
        for info in model.model_fields.values():
            stack = [info.annotation]
            while stack:
                t = stack.pop()
                if isinstance(t, type) and issubclass(t, BaseModel):
                    todo.append(t)
                stack += typing.get_args(t)
    return found


MODELS = request_models(CompletionRequest, ChatCompletionRequest)


# -- how a row checks its field ----------------------------------------------------------------------------------
class Case:
    """A request that sets one field, and what must come of it. ctx: the Checker."""
    def run(self, ctx, endpoint: str, field: str):
        raise NotImplementedError


class Sampling(Case):
    """body[field] = value reaches SamplingParams.<sp_field> as `expected` (default: value itself)."""
    def __init__(self, value, sp_field=None, expected=None, more=None):
        self.value, self.sp_field, self.expected, self.more = value, sp_field, expected, more or {}

    def run(self, ctx, endpoint, field):
        sp = ctx.sampling_params(endpoint, {field: self.value, **self.more})
        want = self.value if self.expected is None else self.expected
        assert sp[self.sp_field or field] == want, (field, sp)


class Refused(Case):
    """body[field] = value is a 400 naming the field."""
    def __init__(self, value):
        self.value = value

    def run(self, ctx, endpoint, field):
        res = ctx.post(endpoint, {field: self.value})
        assert res.status_code == 400 and res.json()["error"]["param"] == field, (field, res.text)


class Rendered(Case):
    """The chat request `body` reaches the engine as HF's rendering of `messages` (the oracle), and that
    rendering differs from `without`'s, so the field changed the prompt."""
    def __init__(self, body, messages, without=None, **template_kwargs):
        self.body, self.messages, self.without, self.kwargs = body, messages, without, template_kwargs

    def run(self, ctx, endpoint, field):
        want = ctx.render(self.messages, **self.kwargs)
        if self.without is not None:
            assert want != ctx.render(*self.without), f"{field}: the row's value does not change the prompt"
        added = ctx.added(endpoint, self.body)
        assert added["prompt_token_ids"] == want, (field, ctx.tokenizer.decode(added["prompt_token_ids"]))


class Check(Case):
    """Anything else: fn(ctx, endpoint) asserts what the field does."""
    def __init__(self, fn):
        self.fn = fn

    def run(self, ctx, endpoint, field):
        self.fn(ctx, endpoint)


_ROWS = itertools.count()


class Checker:
    """Requests to `server` (one at a time) and what its fake engine recorded of them."""
    def __init__(self, server, tokenizer):
        self.server, self.tokenizer = server, tokenizer

    def base(self, endpoint) -> dict:
        """A fresh request body: a prompt no other request sends."""
        text = f"audit row {next(_ROWS)}"
        if endpoint == "completions":
            return {"prompt": text, "max_tokens": 4}
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 4}

    def post(self, endpoint, fields, base=None):
        body = {**(base or self.base(endpoint)), **fields}
        return httpx.post(f"{self.server.url}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}",
                          json=body, timeout=30)

    def render(self, messages, add_generation_prompt=True, **kwargs):
        return self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                                  return_dict=False, **kwargs)

    def added(self, endpoint, fields, base=None) -> dict:
        """The fake engine's add event of the request base + fields: the last one, as the requests of this
        module run one at a time and the engine records an add before the answer is sent."""
        before = len(self.server.events("add"))
        res = self.post(endpoint, fields, base)
        assert res.status_code == 200, res.text
        events = self.server.events("add")
        assert len(events) == before + 1, f"{len(events) - before} adds for one request"
        return events[-1]

    def sampling_params(self, endpoint, fields) -> dict:
        return self.added(endpoint, fields)["sampling_params"]


# -- the table ---------------------------------------------------------------------------------------------------
def _model(ctx, endpoint):
    assert ctx.post(endpoint, {"model": "fake"}).status_code == 200
    res = ctx.post(endpoint, {"model": "gpt-4"})
    assert res.status_code == 404 and res.json()["error"]["param"] == "model"


def _stream(ctx, endpoint):
    base = ctx.base(endpoint)
    full = ctx.post(endpoint, {"temperature": 0}, base).json()
    with httpx.stream("POST", f"{ctx.server.url}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}",
                      json={**base, "temperature": 0, "stream": True}, timeout=30) as res:
        lines = [line for line in res.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    if endpoint == "completions":
        text, want = "".join(c["choices"][0]["text"] for c in chunks), full["choices"][0]["text"]
    else:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        want = full["choices"][0]["message"]["content"]
    assert text == want and text


def _stream_chunks(ctx, endpoint, extra: dict) -> list[dict]:
    with httpx.stream("POST", f"{ctx.server.url}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}",
                      json={**ctx.base(endpoint), "stream": True, **extra}, timeout=30) as res:
        return [json.loads(line[6:]) for line in res.iter_lines() if line.startswith("data: {")]


def _include_usage(ctx, endpoint):
    """OpenAI: with include_usage, one more chunk with choices [] and the usage, and "usage": null on every
    other chunk; without it, no chunk has a usage key (it was "usage": null on every chunk before)."""
    chunks = _stream_chunks(ctx, endpoint, {"stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert len(chunks) > 2 and all("usage" in c and c["usage"] is None for c in chunks[:-1])
    for extra in ({}, {"stream_options": {"include_usage": False}}):
        plain = _stream_chunks(ctx, endpoint, extra)
        assert plain and all(c["choices"] for c in plain)
        assert [c for c in plain if "usage" in c] == []


def _user(ctx, endpoint):
    """OpenAI's `user` identifies the caller's end user (abuse monitoring); it changes nothing in the answer."""
    base = ctx.base(endpoint)
    plain, tagged = ctx.post(endpoint, {}, base).json(), ctx.post(endpoint, {"user": "alice"}, base).json()
    assert plain["choices"] == tagged["choices"] and plain["usage"] == tagged["usage"]


def _prompt(ctx, endpoint):
    added = ctx.added(endpoint, {"prompt": [5, 17, 42, 99, 3]})
    assert added["prompt_token_ids"] == [5, 17, 42, 99, 3]
    text = "The quick brown fox"
    assert ctx.added(endpoint, {"prompt": text})["prompt_token_ids"] == ctx.tokenizer.encode(text)


def _completion_logprobs(ctx, endpoint):
    base = ctx.base(endpoint)
    sp = ctx.added(endpoint, {"logprobs": 2}, base)["sampling_params"]
    assert sp["logprobs"] == 2
    lp = ctx.post(endpoint, {"logprobs": 2}, base).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and all(2 <= len(top) <= 3 for top in lp["top_logprobs"])


def _chat_logprobs(ctx, endpoint):
    base = ctx.base(endpoint)
    assert ctx.added(endpoint, {"logprobs": True}, base)["sampling_params"]["logprobs"] == 0
    content = ctx.post(endpoint, {"logprobs": True}, base).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(c["top_logprobs"] == [] for c in content)


def _top_logprobs(ctx, endpoint):
    base = ctx.base(endpoint)
    assert ctx.added(endpoint, {"logprobs": True, "top_logprobs": 3}, base)["sampling_params"]["logprobs"] == 3
    content = ctx.post(endpoint, {"logprobs": True, "top_logprobs": 3}, base).json()["choices"][0]["logprobs"]["content"]
    assert [len(c["top_logprobs"]) for c in content] == [3, 3, 3, 3]


def _max_completion_tokens(ctx, endpoint):
    assert ctx.sampling_params(endpoint, {"max_completion_tokens": 6})["max_tokens"] == 6
    assert ctx.sampling_params(endpoint, {"max_tokens": 3, "max_completion_tokens": 5})["max_tokens"] == 5


def _messages(ctx, endpoint):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another."}]
    Rendered({"messages": messages}, messages).run(ctx, endpoint, "messages")


def _text_part_type(ctx, endpoint):
    res = ctx.post(endpoint, {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]})
    assert res.status_code == 400 and res.json()["error"]["param"] == "messages"
    _text_part_text(ctx, endpoint)


def _text_part_text(ctx, endpoint):
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]
    Rendered({"messages": [{"role": "user", "content": parts}]},
             [{"role": "user", "content": "first part\nsecond part"}]).run(ctx, endpoint, "content")


def _history_null(field):
    """An OpenAI client's own assistant message sent back as history carries `field: null`: accepted, and the
    prompt is the message's role and content alone (HF's rendering); a value is refused naming messages."""
    def check(ctx, endpoint):
        history = [*USER, {"role": "assistant", "content": "Me."}, {"role": "user", "content": "Who?"}]
        sent = [dict(m, **({field: None} if m["role"] == "assistant" else {})) for m in history]
        assert ctx.added(endpoint, {"messages": sent})["prompt_token_ids"] == ctx.render(history)
        value = [{"id": "c1", "type": "function"}] if field == "tool_calls" else "text"
        sent[1][field] = value
        res = ctx.post(endpoint, {"messages": sent})
        assert res.status_code == 400 and res.json()["error"]["param"] == "messages", res.text
        assert field in res.json()["error"]["message"], res.text
    return Check(check)


def _parallel_tool_calls(ctx, endpoint):
    """No tools run, so no call is made in parallel: true and false hold alike and change nothing sampled."""
    base = ctx.base(endpoint)
    plain = ctx.added(endpoint, {}, base)
    for value in (True, False):
        got = ctx.added(endpoint, {"parallel_tool_calls": value}, base)
        assert (got["sampling_params"], got["prompt_token_ids"]) == (plain["sampling_params"],
                                                                      plain["prompt_token_ids"])


USER = [{"role": "user", "content": "Who is there?"}]
NAMED = [{"role": "user", "content": "Who is there?", "name": "alice"}]
SHARED = {   # the fields both endpoints have (_SamplingFields), one row each, checked on both
    "model": Check(_model),
    "temperature": Sampling(0.7),
    "top_p": Sampling(0.9),
    "n": Sampling(2),
    "stream": Check(_stream),
    "stream_options": Check(_include_usage),
    "stop": Sampling(["xyz"]),
    "seed": Sampling(3),
    "presence_penalty": Sampling(0.5),
    "frequency_penalty": Sampling(-0.5),
    "logit_bias": Refused({"5": 10.0}),
    "user": Check(_user),
    "top_k": Sampling(5),
    "min_p": Sampling(0.1),
    "repetition_penalty": Sampling(1.2),
    "min_tokens": Sampling(2),
    "ignore_eos": Sampling(True),
    "stop_token_ids": Sampling([5]),
    "include_stop_str_in_output": Sampling(True),
    "skip_special_tokens": Sampling(False),
}
FIELDS = {
    **{f"CompletionRequest.{name}": ("completions", case) for name, case in SHARED.items()},
    **{f"ChatCompletionRequest.{name}": ("chat", case) for name, case in SHARED.items()},
    "CompletionRequest.prompt": ("completions", Check(_prompt)),
    "CompletionRequest.max_tokens": ("completions", Sampling(7)),
    "CompletionRequest.logprobs": ("completions", Check(_completion_logprobs)),
    "CompletionRequest.echo": ("completions", Refused(True)),
    "CompletionRequest.best_of": ("completions", Refused(2)),
    "CompletionRequest.suffix": ("completions", Refused("!")),
    "ChatCompletionRequest.messages": ("chat", Check(_messages)),
    "ChatCompletionRequest.max_tokens": ("chat", Sampling(7)),
    "ChatCompletionRequest.max_completion_tokens": ("chat", Check(_max_completion_tokens)),
    "ChatCompletionRequest.logprobs": ("chat", Check(_chat_logprobs)),
    "ChatCompletionRequest.top_logprobs": ("chat", Check(_top_logprobs)),
    "ChatCompletionRequest.response_format": ("chat", Refused({"type": "json_object"})),
    "ChatCompletionRequest.tools": ("chat", Refused([{"type": "function", "function": {"name": "f"}}])),
    "ChatCompletionRequest.tool_choice": ("chat", Refused("auto")),
    "ChatCompletionRequest.parallel_tool_calls": ("chat", Check(_parallel_tool_calls)),
    "ChatCompletionRequest.add_generation_prompt": ("chat", Rendered(
        {"messages": USER, "add_generation_prompt": False}, USER, (USER,), add_generation_prompt=False)),
    "ChatCompletionRequest.chat_template_kwargs": ("chat", Rendered(
        {"messages": USER, "chat_template_kwargs": {"persona": "pirate"}}, USER, (USER,), persona="pirate")),
    "ChatMessage.role": ("chat", Rendered({"messages": [{"role": "developer", "content": "Be brief."}, *USER]},
                                          [{"role": "developer", "content": "Be brief."}, *USER],
                                          ([{"role": "system", "content": "Be brief."}, *USER],))),
    "ChatMessage.content": ("chat", Check(_messages)),
    "ChatMessage.name": ("chat", Rendered({"messages": NAMED}, NAMED, (USER,))),
    **{f"ChatMessage.{name}": ("chat", _history_null(name)) for name in ("tool_calls", "refusal", "function_call",
                                                                         "audio", "annotations")},
    "TextPart.type": ("chat", Check(_text_part_type)),
    "TextPart.text": ("chat", Check(_text_part_text)),
    "StreamOptions.include_usage": ("completions", Check(_include_usage)),
}


def test_every_request_field_has_a_row():
    fields = {f"{name}.{field}" for name, model in MODELS.items() for field in model.model_fields}
    assert set(MODELS) == {"CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TextPart", "StreamOptions"}
    assert fields - set(FIELDS) == set(), "a request field without a row: say where it goes, or refuse it by name"
    assert set(FIELDS) - fields == set(), "a row for a field the models no longer have"


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_the_field_reaches_the_engine_or_is_refused_by_name(server, tokenizer, key):
    endpoint, case = FIELDS[key]
    case.run(Checker(server, tokenizer), endpoint, key.split(".", 1)[1])
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_a_named_message_renders_as_llm_chat_and_hf_render_it(server, tokenizer):
    """The reported fault: a message's `name` was dropped, so the server rendered fewer prompt tokens than
    LLM.chat and HF, and answered another prompt."""
    from nanovllm_ref.llm import chat_token_ids
    messages = [{"role": "system", "content": "Two people talk to you."},
                {"role": "user", "content": "I like tea.", "name": "alice"},
                {"role": "user", "content": "I like coffee.", "name": "bob"}]
    want = chat_token_ids(tokenizer, messages)
    assert want == tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    res = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=30)
    assert res.status_code == 200, res.text
    assert res.json()["usage"]["prompt_tokens"] == len(want)
    assert server.events("add")[-1]["prompt_token_ids"] == want


@pytest.mark.parametrize("logprobs", [False, True], ids=["text_path", "logprobs_path"])
def test_a_streamed_chat_delta_holds_only_what_it_sets(server, tokenizer, logprobs):
    """OpenAI's chat chunk deltas: a choice opens with {"role": "assistant", "content": ""}, text chunks carry
    {"content": ...} alone and the chunk that ends it {} (with its finish_reason); "finish_reason": null stays on
    the others. Before, every delta wrote both keys ({"role": null, "content": null} at the end). The server's
    fast text path and its pydantic path (logprobs) must agree."""
    ctx = Checker(server, tokenizer)
    extra = {"n": 2, "temperature": 1.0, "seed": 3} | ({"logprobs": True, "top_logprobs": 1} if logprobs else {})
    chunks = _stream_chunks(ctx, "chat", extra)
    by_choice = {}
    for c in chunks:
        (choice,) = c["choices"]
        assert "finish_reason" in choice
        by_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(by_choice) == [0, 1]
    for index, seen in by_choice.items():
        assert seen[0]["delta"] == {"role": "assistant", "content": ""} and seen[0]["finish_reason"] is None
        assert seen[-1]["delta"] == {} and seen[-1]["finish_reason"] == "length"
        middle = seen[1:-1]
        assert middle and all(set(s["delta"]) == {"content"} and s["finish_reason"] is None for s in middle)
