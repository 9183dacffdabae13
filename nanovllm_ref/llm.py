"""The public entry point, as in vLLM: `LLM(model_path, **engine_args).generate(prompts, sampling_params)`,
and `LLM.chat(messages, sampling_params)` for chat models."""
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC

from nanovllm_ref.engine.llm_engine import LLMEngine


def chat_token_ids(tokenizer, conversation, add_generation_prompt: bool = True, chat_template=None,
                   where: str = "messages") -> list[int]:
    """Token ids of one conversation rendered by the tokenizer's chat template, as HF does it.

    conversation: a list of {"role": str, "content": str} dicts. The ids come from
    `tokenizer.apply_chat_template(..., tokenize=True)`, so special tokens are not added a second time
    (rendering to text and encoding that text would add another BOS when the template writes one).
    chat_template: a Jinja template to use instead of the tokenizer's own.
    Raises TypeError for a malformed conversation, ValueError if there is no chat template.
    """
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, SequenceABC) or not conversation:
        raise TypeError(f"{where} must be a non-empty list of {{'role': str, 'content': str}} dicts, "
                        f"got {type(conversation).__name__}")
    for j, m in enumerate(conversation):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"{where}[{j}] must be a dict with str 'role' and 'content', got {m!r:.80}")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass chat_template=, or use generate()")
    ids = tokenizer.apply_chat_template([dict(m) for m in conversation], tokenize=True, return_dict=False,
                                        add_generation_prompt=add_generation_prompt, chat_template=chat_template)
    return [int(t) for t in ids]


class LLM(LLMEngine):
    """An offline inference engine over a local model folder (config.json + *.safetensors + tokenizer).

    See `nanovllm_ref.config.Config` for the engine arguments and `LLMEngine.generate` for the call.
    """

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[dict]:
        """Answer chat conversations, as vLLM's `LLM.chat`.

        messages: one conversation (a list of {"role", "content"} dicts, e.g. [{"role": "user", "content":
        "Hi"}]) or a list of conversations. Each is tokenized by the tokenizer's chat template straight to
        ids (`chat_token_ids`), then generated as `generate` does; sampling_params and the returned dicts are
        `generate`'s (one dict per conversation). Raises TypeError/ValueError before any work.
        """
        self._check_open()
        if (isinstance(messages, SequenceABC) and not isinstance(messages, (str, bytes)) and messages
                and isinstance(messages[0], Mapping)):
            messages = [messages]                         # one conversation
        if isinstance(messages, (str, bytes)) or not isinstance(messages, SequenceABC) or not messages:
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a "
                            f"non-empty list of them, got {type(messages).__name__}")
        prompts = [chat_token_ids(self.tokenizer, conv, add_generation_prompt, chat_template, f"messages[{i}]")
                   for i, conv in enumerate(messages)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
