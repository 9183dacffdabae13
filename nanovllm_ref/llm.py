"""The public entry point, as in vLLM: `LLM(model_path, **engine_args).generate(prompts, sampling_params)`,
and `LLM.chat(messages, sampling_params)` for chat models."""
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC

from nanovllm_ref.engine.llm_engine import LLMEngine
from nanovllm_ref.engine.request import check_text
from nanovllm_ref.outputs import RequestOutput

# apply_chat_template's own parameters: chat_template_kwargs may not set them (they are chat()'s arguments,
# or fixed here).
_RESERVED = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
             "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
             "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens")


def _check_texts(value, where: str) -> None:
    """check_text on every str in `value` (nested dicts and lists), naming the first bad one by its path, e.g.
    `messages[1].content`: text the template renders must be text the tokenizer can encode."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_texts(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_texts(v, f"{where}[{i}]")


def check_chat_template_kwargs(chat_template_kwargs,
                              own_parameters: str = "pass add_generation_prompt= etc. to chat() itself") -> dict:
    """chat_template_kwargs as a dict ({} for None). Raises TypeError unless it is a dict with str keys, ValueError
    if it sets one of apply_chat_template's own parameters (`own_parameters` says the caller where those are set
    instead) or holds text that is not valid (check_text)."""
    kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"chat_template_kwargs must be a dict with str keys or None, got {chat_template_kwargs!r:.80}")
    reserved = sorted(set(kwargs) & set(_RESERVED))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: they are apply_chat_template's own "
                         f"parameters ({own_parameters})")
    _check_texts(dict(kwargs), "chat_template_kwargs")
    return dict(kwargs)


def _check_conversation(conversation, where: str) -> None:
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, SequenceABC) or not conversation:
        raise TypeError(f"{where} must be a non-empty list of {{'role': str, 'content': str}} dicts, "
                        f"got {type(conversation).__name__}")
    for j, m in enumerate(conversation):
        ok = isinstance(m, Mapping) and isinstance(m.get("role"), str)
        content = m.get("content") if ok else None
        # content: a str; a list of parts ({"type": "text", "text": ...}) or None are passed on to the
        # template; a message without content must carry tool_calls (an assistant calling a tool).
        if ok and "content" not in m:
            ok = "tool_calls" in m
        elif ok:
            ok = content is None or isinstance(content, (str, list))
        if not ok:
            raise TypeError(f"{where}[{j}] must be a dict with a str 'role' and a str 'content', got {m!r:.80}")
        _check_texts(dict(m), f"{where}[{j}]")


def chat_token_ids(tokenizer, conversation, add_generation_prompt: bool = True, chat_template=None,
                   where: str = "messages", *, continue_final_message: bool = False, tools=None, documents=None,
                   chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of one conversation rendered by the tokenizer's chat template, as HF does it.

    conversation: a list of {"role": str, "content": str} dicts (content may also be a list of parts or
    None, and a message may carry "tool_calls": they go to the template as they are). The ids come from
    `tokenizer.apply_chat_template(..., tokenize=True)`, so special tokens are not added a second time
    (rendering to text and encoding that text would add another BOS when the template writes one).
    add_generation_prompt: end with the assistant's turn opening. continue_final_message: leave the last
    message open so the model continues it (needs add_generation_prompt=False, as in HF and vLLM).
    chat_template: a Jinja template to use instead of the tokenizer's own. tools: a list of JSON-schema
    dicts (or functions, which transformers converts); documents: a list of {"title", "text"} dicts for RAG
    templates. chat_template_kwargs: more variables for the template, e.g. {"enable_thinking": False} for
    Qwen3 (not apply_chat_template's own parameters).
    Raises TypeError for a malformed argument, ValueError if there is no chat template, for text that is not
    valid (a lone surrogate, named by its path: `messages[1].content`), for an error the template raises when it
    compiles or renders (jinja), or one from transformers, naming the argument.
    """
    _check_conversation(conversation, where)
    if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final_message, bool):
        raise TypeError("add_generation_prompt and continue_final_message must be bools")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True continues the last message, so it needs "
                         "add_generation_prompt=False (a new assistant turn would start after it)")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a str (a Jinja template) or None, got {type(chat_template).__name__}")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass chat_template=, or use generate()")
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and (isinstance(value, (str, bytes, Mapping)) or not isinstance(value, SequenceABC)):
            raise TypeError(f"{name} must be a list or None, got {type(value).__name__}")
    kwargs = check_chat_template_kwargs(chat_template_kwargs)
    _check_texts(tools, "tools")
    _check_texts(documents, "documents")
    # The advice names only what the caller gave: a chat shell user has no tools or chat_template_kwargs to check.
    given = [where] + [name for name, value in (("tools", tools), ("documents", documents),
                                                ("chat_template_kwargs", kwargs)) if value]
    given = ", ".join(given[:-1]) + " and " + given[-1] if len(given) > 1 else given[0]
    import jinja2
    try:
        ids = tokenizer.apply_chat_template([dict(m) for m in conversation], tools=tools, documents=documents,
                                            chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tokenize=True,
                                            return_dict=False, **kwargs)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not compile (jinja, line {exc.lineno}): {exc.message}") from exc
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template failed to render {where} (jinja: {exc}); check {given} against what "
                         "the template expects") from exc
    except Exception as exc:
        raise ValueError(f"apply_chat_template refused {where} ({type(exc).__name__}: {exc}); check {given}") from exc
    if len(ids) == 0:       # named here: the engine's own "prompts[i] is empty" would point at the wrong argument
        raise ValueError(f"the chat template rendered {where} to no tokens; check {given} against what the "
                         "template expects")
    return [int(t) for t in ids]


class LLM(LLMEngine):
    """An offline inference engine over a local model folder (config.json + *.safetensors + tokenizer).

    See `nanovllm_ref.config.Config` for the engine arguments and `LLMEngine.generate` for the call.
    """

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools=None, documents=None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Answer chat conversations, as vLLM's `LLM.chat`.

        messages: one conversation (a list of {"role", "content"} dicts, e.g. [{"role": "user", "content":
        "Hi"}]) or a list of conversations. Each is tokenized by the tokenizer's chat template straight to
        ids (`chat_token_ids`, which documents chat_template, add_generation_prompt, continue_final_message,
        tools, documents and chat_template_kwargs; they apply to every conversation), then generated as
        `generate` does; sampling_params and the returned RequestOutputs (one per conversation, `.prompt`
        None) are `generate`'s. Raises TypeError/ValueError before any work.
        """
        self._check_open()
        if (isinstance(messages, SequenceABC) and not isinstance(messages, (str, bytes)) and messages
                and isinstance(messages[0], Mapping)):
            messages = [messages]                         # one conversation
        if isinstance(messages, (str, bytes)) or not isinstance(messages, SequenceABC) or not messages:
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a "
                            f"non-empty list of them, got {type(messages).__name__}")
        prompts = [chat_token_ids(self.tokenizer, conv, add_generation_prompt, chat_template, f"messages[{i}]",
                                  continue_final_message=continue_final_message, tools=tools, documents=documents,
                                  chat_template_kwargs=chat_template_kwargs)
                   for i, conv in enumerate(messages)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
