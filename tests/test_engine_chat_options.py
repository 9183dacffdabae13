"""LLM.chat passes the chat options through to apply_chat_template as HF and vLLM do (HF is the oracle for
the prompt ids), and turns template and transformers errors into ValueErrors that name the argument."""
import pytest

from nanovllm_ref import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
CONV = [{"role": "user", "content": "Hello"}]
# A Qwen3-like template: tools and documents in a system turn, enable_thinking as Qwen3 reads it.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% if documents %}<|im_start|>system\n{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {}}}}]
DOCS = [{"title": "Paris", "text": "Paris is the capital of France."}]


LLM_ARGS = dict(kvcache_block_size=4, max_model_len=128)      # the llm fixture (tests/conftest.py)


def hf_ids(llm, conv, **kwargs):
    return llm.tokenizer.apply_chat_template(conv, tokenize=True, return_dict=False, **kwargs)


def prompt_of(llm, conv, **kwargs):
    out = llm.chat(conv, SP, use_tqdm=False, **kwargs)[0]
    assert len(out.outputs[0].token_ids) == 2 and out.prompt is None
    return out.prompt_token_ids


def test_chat_template_kwargs_reach_the_template(llm):
    off = prompt_of(llm, CONV, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": False})
    assert off == hf_ids(llm, CONV, chat_template=TEMPLATE, add_generation_prompt=True, enable_thinking=False)
    assert off != prompt_of(llm, CONV, chat_template=TEMPLATE)
    assert llm.tokenizer.decode(off).endswith("<think>\n\n</think>\n\n")


def test_tools_and_documents_reach_the_template(llm):
    ids = prompt_of(llm, CONV, chat_template=TEMPLATE, tools=TOOLS, documents=DOCS)
    assert ids == hf_ids(llm, CONV, chat_template=TEMPLATE, tools=TOOLS, documents=DOCS, add_generation_prompt=True)
    text = llm.tokenizer.decode(ids)
    assert "Tools: get_weather" in text and "[Paris] Paris is the capital" in text


def test_continue_final_message_and_no_generation_prompt(llm):
    conv = CONV + [{"role": "assistant", "content": "The capital of France is"}]
    ids = prompt_of(llm, conv, add_generation_prompt=False, continue_final_message=True)
    assert ids == hf_ids(llm, conv, add_generation_prompt=False, continue_final_message=True)
    assert llm.tokenizer.decode(ids).endswith("assistant\nThe capital of France is")
    closed = prompt_of(llm, conv, add_generation_prompt=False)
    assert closed == hf_ids(llm, conv, add_generation_prompt=False)
    assert llm.tokenizer.decode(closed).endswith("<|im_end|>\n")


def test_tool_call_messages_without_content_go_to_the_template(llm):
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}call "
                "{{ m.tool_calls[0]['function']['name'] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
                "{% endfor %}<|im_start|>assistant\n")
    conv = CONV + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                                          "arguments": {}}}]},
                   {"role": "tool", "content": "sunny"}]
    ids = prompt_of(llm, conv, chat_template=template, tools=TOOLS)
    assert ids == hf_ids(llm, conv, chat_template=template, tools=TOOLS)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(chat_template="{% for m in messages %}{{ m.content }"), ValueError, "chat_template does not compile"),
    (dict(chat_template="{{ raise_exception('no system role') }}"), ValueError, "failed to render.*no system role"),
    (dict(chat_template_kwargs={"tokenize": False}), ValueError, r"chat_template_kwargs may not set \['tokenize'\]"),
    (dict(chat_template_kwargs={"messages": []}), ValueError, r"chat_template_kwargs may not set \['messages'\]"),
    (dict(chat_template_kwargs=["enable_thinking"]), TypeError, "chat_template_kwargs must be a dict"),
    (dict(continue_final_message=True), ValueError, "add_generation_prompt=False"),
    (dict(tools={"name": "f"}), TypeError, "tools must be a list"),
    (dict(documents="Paris"), TypeError, "documents must be a list"),
    (dict(chat_template=3), TypeError, "chat_template must be a str"),
    # a template that renders nothing: named as the conversation, not as "prompts[0] is empty"
    (dict(chat_template="{% if false %}x{% endif %}"), ValueError, r"rendered messages\[0\] to no tokens"),
])
def test_bad_chat_options_raise_named_errors_before_any_work(llm, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        llm.chat([CONV, CONV], SP, use_tqdm=False, **kwargs)
    assert llm.is_finished() and not llm.requests
    assert llm.chat(CONV, SP, use_tqdm=False)[0].finished
