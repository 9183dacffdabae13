"""An interactive chat shell: `python -m nanovllm_ref chat --model PATH` (serving chapter, lecture demos).

It keeps the conversation's history, renders it with the model's chat template every turn, and streams the
answer as the engine produces it: the same request API the server drives (serving_engine.py), with no HTTP
in between. Each step's cumulative text is printed as its difference from what is already on the screen.

Keys: Enter sends a line; Ctrl-C during an answer stops it (the request is aborted between two steps, never
inside one, and the text so far stays in the history); Ctrl-C at the prompt only says how to quit;
Ctrl-D or `/exit` quits; `/reset` starts a new conversation.
"""
import signal
import sys

from nanovllm_ref.entrypoints.openai.protocol import APIError
from nanovllm_ref.entrypoints.openai.sampling import resolve_max_tokens
from nanovllm_ref.sampling_params import SamplingParams

HELP = "Ctrl-C stops an answer, /reset starts over, Ctrl-D or /exit quits."


class ChatShell:
    """engine: a ServingEngine this shell alone drives. system: an optional system message. max_tokens,
    temperature: each answer's SamplingParams (max_tokens is lowered to what the context has left)."""

    def __init__(self, engine, system: str | None = None, max_tokens: int = 256, temperature: float = 0.0,
                 out=None):
        if not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template, which the chat shell needs; "
                             "use `generate` or `serve` (/v1/completions) instead")
        self.engine = engine
        self.system = system
        self.max_tokens = max_tokens
        self.sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens)   # checks both now
        self.out = out or sys.stdout
        self.history: list[dict] = []
        self.turns = 0
        self._interrupted = False
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _on_sigint(self, signum, frame):
        self._interrupted = True

    def answer(self, user_text: str) -> str | None:
        """Stream the answer to one user message and add both to the history. Returns the answer's text (what
        was printed, also when stopped), or None if the message is not valid text (a lone surrogate: stdin
        bytes that are not UTF-8) or the conversation no longer fits (nothing is kept)."""
        from nanovllm_ref.engine.request import check_text
        from nanovllm_ref.llm import chat_token_ids
        try:                                 # the line itself is at fault, not the history: say so, keep nothing
            check_text(user_text, "your message")
        except ValueError as exc:
            self._write(f"error: {exc}\n")
            return None
        self.history.append({"role": "user", "content": user_text})
        try:
            ids = chat_token_ids(self.engine.tokenizer, self.history)
            room = resolve_max_tokens(None, len(ids), self.engine.max_model_len, prompt_field="messages",
                                      kv_cache_tokens=self.engine.kv_cache_tokens)
            sp = SamplingParams(temperature=self.sampling.temperature, max_tokens=min(self.max_tokens, room))
            request_id = f"chat-{self.turns + 1}"
            self.engine.add_request(ids, sp, request_id)   # its check refuses what can never fit the KV cache
        except (APIError, ValueError, TypeError) as exc:
            self.history.pop()
            self._write(f"error: {exc} (/reset clears the history)\n")
            return None
        self.turns += 1
        shown, stopped = "", False
        self._interrupted = False
        previous = signal.signal(signal.SIGINT, self._on_sigint)   # Ctrl-C is read between steps
        try:
            while self.engine.has_unfinished_requests():
                if self._interrupted:
                    self.engine.abort_request(request_id)
                    stopped = True
                    break
                for out in self.engine.step():
                    if out.request_id == request_id:
                        text = out.outputs[0].text
                        self._write(text[len(shown):])
                        shown = text
        finally:
            signal.signal(signal.SIGINT, previous)
        self._write("\n[stopped]\n" if stopped else "\n")
        self.history.append({"role": "assistant", "content": shown})
        return shown

    def run(self, read=input) -> None:
        """Read lines until Ctrl-D or /exit."""
        self._write(f"{HELP}\n")
        while True:
            try:
                line = read(">>> ")
            except EOFError:
                self._write("\n")
                return
            except KeyboardInterrupt:
                self._write(f"\n({HELP})\n")
                continue
            text = line.strip()
            if text in ("/exit", "/quit"):
                return
            if text == "/reset":
                self.reset()
                self._write("(new conversation)\n")
                continue
            if text:
                self.answer(text)


def run_chat(args, model_path: str, engine_args: dict) -> int:
    """Build the engine (serving_engine.build_engine), run the shell, free the engine; returns 0."""
    from nanovllm_ref.entrypoints.openai.serving_engine import build_engine
    shell_args = dict(system=args.system, max_tokens=args.max_tokens, temperature=args.temperature)
    SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)       # bad flags fail before loading
    engine = build_engine(model_path, engine_args, args.engine_factory, args.engine_factory_kwargs)
    if hasattr(sys.stdin, "reconfigure"):      # bytes that are not UTF-8 arrive as lone surrogates (answer() says
        sys.stdin.reconfigure(errors="surrogateescape")   # so), not as a UnicodeDecodeError out of input()
    try:
        ChatShell(engine, **shell_args).run()
    finally:
        engine.exit()
    return 0
