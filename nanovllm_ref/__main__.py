"""Command line: `python -m nanovllm_ref {demo,generate,serve,chat,doctor}`, plus the commands other installed
packages register (nanovllm_ref/plugins.py): this project registers `download` (checkpoint tooling) and `bench`.

    python -m nanovllm_ref download smollm2          # fetch + convert the real model (once)
    python -m nanovllm_ref demo                      # answer a few chat prompts with SmolLM2
    python -m nanovllm_ref generate --model smollm2 --prompt "The capital of France is" --temperature 0
    python -m nanovllm_ref generate --model PATH --chat --prompt "Tell me a joke"
    python -m nanovllm_ref serve --model PATH --port 8000    # OpenAI-compatible server (entrypoints/openai)
    python -m nanovllm_ref chat --model PATH                 # chat in the terminal, answers streamed
    python -m nanovllm_ref doctor                    # torch / CUDA / Triton / flash-attn status
    python -m nanovllm_ref bench --help              # throughput benchmark (output tokens/s)
"""
import argparse
import os
import sys
import time
import warnings

# Prompts SmolLM2-135M-Instruct answers well (greedy, fp32 on CPU, 2026-11-30). It got the KV cache, a
# haiku, prime numbers and the largest planet wrong, so those are not demo prompts.
DEMO_PROMPTS = [
    "What is the capital of France?",
    "Name three fruits.",
    "What is 2 + 3?",
    "Give me three tips for staying healthy.",
]


def _model_path(name_or_path: str) -> str:
    from nanovllm_ref import plugins
    return plugins.model_path(name_or_path)


def _engine_args(args) -> dict:
    out = dict(max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, device=args.device,
               dtype=args.dtype, attention_backend=args.attention_backend,
               tensor_parallel_size=args.tensor_parallel_size)
    if args.kvcache_block_size:
        out["kvcache_block_size"] = args.kvcache_block_size
    return out


def _add_engine_flags(p):
    p.add_argument("--model", default="smollm2", help="model folder, or a name from `download`")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion, in tokens; None: the model's max_position_embeddings, at most 4096")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: the checkpoint's dtype on GPU, float32 on CPU")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flash_attn", "triton", "torch", "cpu"],
                   help="attention kernels")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (or CPU ranks) per layer")
    p.add_argument("--kvcache-block-size", type=int, default=0, help="0 = engine default")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


DEMO_NOTE = ("SmolLM2-135M-Instruct is a very small model (135 M parameters), here dequantized from a 4-bit "
             "GGUF: expect fluent text and simple answers, but also wrong facts and arithmetic. For better "
             "answers run a larger Qwen3 or Llama folder with --model.")


def _sampling_params(args):
    from nanovllm_ref import SamplingParams
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_k=getattr(args, "top_k", 0),
                          top_p=getattr(args, "top_p", 1.0), n=getattr(args, "n", 1),
                          min_tokens=getattr(args, "min_tokens", 0), stop=getattr(args, "stop", None),
                          stop_token_ids=getattr(args, "stop_token_ids", None),
                          include_stop_str_in_output=getattr(args, "include_stop_str_in_output", False),
                          skip_special_tokens=getattr(args, "skip_special_tokens", True))


def cmd_generate(args, prompts=None, chat=None, note=None):
    from nanovllm_ref import LLM
    from nanovllm_ref.config import Config
    from nanovllm_ref.engine.request import check_request, encode_text, load_tokenizer
    from nanovllm_ref.engine.scheduler import Scheduler
    from nanovllm_ref.llm import chat_token_ids
    # Cheap checks first: sampling settings, engine arguments and config.json, the tokenizer, then every
    # prompt and its settings as the engine will check them; only then load the weights (tens of seconds on
    # a CPU).
    sp = _sampling_params(args)
    prompts = prompts or args.prompt
    chat = args.chat if chat is None else chat
    path, engine_args = _model_path(args.model), _engine_args(args)
    config = Config(path, **engine_args)
    max_len = config.max_model_len
    tokenizer = load_tokenizer(path, config.hf_config.vocab_size)
    token_ids = [chat_token_ids(tokenizer, [{"role": "user", "content": p}], where=f"prompt {i + 1}") if chat
                 else encode_text(tokenizer, p, f"prompt {i + 1}") for i, p in enumerate(prompts)]
    for i, ids in enumerate(token_ids):
        if len(ids) > max_len:
            raise ValueError(f"prompt {i + 1} has {len(ids)} tokens{' with the chat template' if chat else ''}, "
                             f"more than max_model_len={max_len} (--max-model-len)")
        check_request(ids, sp, tokenizer=tokenizer, config=config, scheduler_cls=Scheduler, where=f"prompt {i + 1}",
                      sp_where="the sampling flags")
    llm = LLM(path, **engine_args)
    t = time.perf_counter()
    outputs = llm.generate(token_ids, sp, use_tqdm=True)
    dt = time.perf_counter() - t
    for prompt, ids, out in zip(prompts, token_ids, outputs):
        print(f"\n>>> {prompt}")
        for sample in out.outputs:
            if len(out.outputs) > 1:
                print(f"[sample {sample.index + 1} of {len(out.outputs)}]")
            print(sample.text.strip())
            if sample.finish_reason == "length":
                limit = (f"max_model_len={max_len} (--max-model-len)" if len(ids) + len(sample.token_ids) >= max_len
                         else f"max_tokens={sp.max_tokens} (--max-tokens)")
                print(f"[cut short: reached {limit}]")
    n = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    print(f"\n{len(outputs)} prompts, {n} output tokens in {dt:.2f} s: {n / dt:.1f} output tokens/s "
          f"({llm.model_runner.device_type}, {str(llm.model_runner.dtype).replace('torch.', '')}, "
          f"attention={llm.model_runner.backend_name}, cuda_graphs={not llm.model_runner.enforce_eager})")
    if note:
        print(note)
    llm.exit()


def cmd_doctor(args):
    import platform

    import torch
    from nanovllm_ref import plugins
    from nanovllm_ref.attn import flash_attn_impl, resolve_backend, triton_available
    print(f"python       {platform.python_version()}")
    print(f"torch        {torch.__version__}")
    cuda = torch.cuda.is_available()
    print(f"cuda         {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no (CPU only)'}")
    if triton_available():
        import triton
        mode = "compiled kernels" if cuda else "interpreter (TRITON_INTERPRET=1, slow, for tests)"
        print(f"triton       {triton.__version__}, {mode}")
    else:
        print("triton       not installed")
    impl = flash_attn_impl()
    print(f"flash-attn   {impl.describe() if impl else 'none found (optional: flash-attn, vLLM or flash-attn-4)'}")
    import transformers
    print(f"transformers {transformers.__version__}")
    print(f"attention    auto -> {resolve_backend('auto', 'cuda' if cuda else 'cpu')}")
    for name in sorted(plugins.registered(plugins.MODELS)):
        path = plugins.model_path(name, download=False)
        print(f"{name:12s} {'ready at ' + path if path else 'not downloaded'}")
    print(f"commands     {', '.join(sorted(plugins.registered(plugins.COMMANDS))) or 'none registered'} "
          "(from other installed packages)")


# The engine's own commands; a registered command of the same name does not replace them.
ENGINE_COMMANDS = ("generate", "demo", "serve", "chat", "doctor")


def main(argv=None):
    try:
        return _main(argv)
    except KeyboardInterrupt:                                 # Ctrl-C: one line, the shell's status for SIGINT
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv):
    warnings.filterwarnings("ignore")
    argv = sys.argv[1:] if argv is None else list(argv)
    from nanovllm_ref import plugins
    commands = {k: v for k, v in plugins.registered(plugins.COMMANDS).items() if k not in ENGINE_COMMANDS}
    if argv[:1] and argv[0] in commands:     # another package's command (bench, download): its own parser
        return plugins.run_command(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="python -m nanovllm_ref", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    defaults = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("generate", help="generate text for one or more prompts", formatter_class=defaults)
    _add_engine_flags(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most new tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 or -1 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set with this much "
                   "probability; 1 = off")
    p.add_argument("--n", type=int, default=1, help="completions per prompt (they share the prompt's KV blocks)")
    p.add_argument("--min-tokens", type=int, default=0, help="no stop of any kind before this many new tokens")
    p.add_argument("--stop", action="append", default=None, help="stop at this string (repeat for several); "
                   "the text is cut before it")
    p.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=None,
                   help="stop at this token id (repeat for several)")
    p.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string / stop token's text in the output")
    p.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="leave special tokens out of the text")

    p = sub.add_parser("demo", help="the README demo: SmolLM2 answers a few chat prompts", formatter_class=defaults)
    _add_engine_flags(p)
    p.add_argument("--max-tokens", type=int, default=48, help="most new tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")

    from nanovllm_ref.entrypoints import cli_args
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=defaults)
    _add_engine_flags(p)
    cli_args.add_serve_flags(p)
    p = sub.add_parser("chat", help="chat in the terminal with streamed answers", formatter_class=defaults)
    _add_engine_flags(p)
    cli_args.add_chat_flags(p)

    sub.add_parser("doctor", help="torch / CUDA / Triton / flash-attn status")
    for name, ep in sorted(commands.items()):
        sub.add_parser(name, help=f"from {ep.value.split(':')[0]}; see `{name} --help`")

    args = parser.parse_args(argv)
    try:
        if args.cmd == "generate":
            cmd_generate(args)
        elif args.cmd == "demo":
            cmd_generate(args, prompts=DEMO_PROMPTS, chat=True, note=DEMO_NOTE)
        elif args.cmd in ("serve", "chat"):
            engine_args = {**_engine_args(args), **cli_args.more_engine_args(args)}
            if args.cmd == "serve":
                from nanovllm_ref.entrypoints.openai.api_server import run_server
                return run_server(args, _model_path(args.model), engine_args)
            from nanovllm_ref.entrypoints.chat import run_chat
            return run_chat(args, _model_path(args.model), engine_args)
        elif args.cmd == "doctor":
            cmd_doctor(args)
    except (ValueError, TypeError, RuntimeError) as exc:     # a user error: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
