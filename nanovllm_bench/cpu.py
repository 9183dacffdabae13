"""CPU benchmark on the real model: `python -m nanovllm_bench --cpu` (issue 15, chapter 11).

Model: SmolLM2-135M-Instruct in fp32 (`download.ensure_model()`). Peer: HF transformers `generate` on the same
prompts, left-padded, as one batch, greedy. Both run in this process, interleaved (engine, HF, engine, HF,
...), at each thread count, so a busy machine slows both alike. Each cell is the median of `--repeats` runs
(default 3) with min and max. The load average before and after each workload is recorded: on a shared
2-core machine, 2 threads can be slower than 1 when other processes hold a core.

Workloads:
- "chat8": 8 chat prompts, 64 greedy tokens each, ignore_eos (HF: eos off, 64 new tokens).
- "chat32_eos": 32 chat prompts of mixed lengths (short questions to long documents), eos on, up to
  `--max-tokens-eos` tokens. HF's batch runs until its last row finishes (finished rows are padded);
  the engine drops a finished sequence at once. Tokens counted for both: each completion up to and
  including its eos.
Throughput = completion tokens / wall seconds of one generate call (tokenisation excluded for both).
Greedy ids of each engine run are compared with HF's batch (ids_equal_hf / first_mismatch).
"""
import datetime as dt
import json
import os
import platform
import statistics
import time
import warnings

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Explain in one sentence what a KV cache is.",
    "Write a haiku about GPUs.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
    "Translate 'good morning' into Spanish and German.",
]
_TOPICS = ["the water cycle", "how vaccines work", "the French revolution", "binary search", "photosynthesis",
           "the stock market", "black holes", "how bicycles stay upright", "the history of the internet",
           "climate change", "how to learn a language", "the rules of chess", "how a CPU cache works",
           "volcanoes", "the Roman empire", "sorting algorithms", "the human heart", "electric cars",
           "how bread rises", "the moon landing", "rainbows", "how email works", "the olympic games",
           "honey bees"]
_FILLER = ("Here is some background that you may use. It is a long note written by a student who took careful "
           "notes in class and wants a clear summary of the main ideas, with no jargon. ")


def chat32_questions() -> list[str]:
    """32 prompts: the 8 short questions, then 24 requests with 0..5 sentences of context (mixed lengths)."""
    qs = list(QUESTIONS)
    for i, topic in enumerate(_TOPICS):
        qs.append(_FILLER * (i % 6) + f"Please explain {topic} in a few sentences.")
    return qs


def _chat_ids(tokenizer, questions) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return [tokenizer.encode(t) for t in texts]


def _trim(ids, eos):
    """Completion up to and including the first eos (the engine's convention)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


class HFPeer:
    """HF transformers `generate`, one left-padded batch, greedy."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            self.tok = AutoTokenizer.from_pretrained(path)
        self.tok.padding_side = "left"
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

    def generate(self, prompts, max_new_tokens, eos):
        """Returns (completions, seconds). eos: list of ids, or None for ignore_eos."""
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            # eos_token_id=None as an argument turns stopping off (None inside a GenerationConfig does not:
            # generate fills it in from the checkpoint's generation_config.json).
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                      eos_token_id=eos, pad_token_id=self.pad)
            seconds = time.perf_counter() - t
        comps = [row[width:].tolist() for row in out]
        return [_trim(c, eos) if eos else c for c in comps], seconds


class EnginePeer:
    def __init__(self, path, **engine_args):
        from nanovllm_ref import LLM
        t = time.perf_counter()
        self.llm = LLM(path, **engine_args)
        self.startup_s = time.perf_counter() - t
        runner = self.llm.model_runner
        self.info = dict(backend=runner.backend_name, block_size=self.llm.config.kvcache_block_size,
                         dtype=str(runner.dtype).replace("torch.", ""), startup_s=round(self.startup_s, 2))

    def generate(self, prompts, max_new_tokens, eos):
        from nanovllm_ref import SamplingParams
        sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=eos is None)
        t = time.perf_counter()
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t
        return [o["token_ids"] for o in outs], seconds

    def exit(self):
        self.llm.exit()


def _summary(values):
    return dict(median=statistics.median(values), min=min(values), max=max(values),
                runs=[round(v, 2) for v in values])


def run_workload(name, engine, hf, prompts, max_new_tokens, eos, threads_list, repeats, log, budget_s=None,
                 on_row=None):
    """Interleaved engine/HF runs at each thread count. Returns the workload's record.

    budget_s: after a pair of runs, stop repeating a cell that has taken longer than this (a machine busy with
    other processes can make one run take minutes); the row then says how many runs it has."""
    rec = dict(name=name, num_prompts=len(prompts), prompt_tokens=sum(map(len, prompts)),
               prompt_lens=[min(map(len, prompts)), max(map(len, prompts))], max_new_tokens=max_new_tokens,
               ignore_eos=eos is None, rows=[])
    # One untimed warm-up of each at the first thread count (allocator, lazy inits).
    torch.set_num_threads(threads_list[0])
    engine.generate(prompts[:2], 4, eos)
    hf.generate(prompts[:2], 4, eos)
    for threads in threads_list:
        torch.set_num_threads(threads)
        load_before = os.getloadavg()
        eng, peer, equal, first_bad, eng_tokens, hf_tokens = [], [], [], None, 0, 0
        started = time.perf_counter()
        for r in range(repeats):
            if r > 0 and budget_s is not None and time.perf_counter() - started > budget_s:
                log(f"  {name} threads={threads}: stopped after {r} runs ({time.perf_counter() - started:.0f} s > "
                    f"budget {budget_s:.0f} s; machine busy)")
                break
            comps_e, sec_e = engine.generate(prompts, max_new_tokens, eos)
            comps_h, sec_h = hf.generate(prompts, max_new_tokens, eos)
            eng_tokens, hf_tokens = sum(map(len, comps_e)), sum(map(len, comps_h))
            eng.append(eng_tokens / sec_e)
            peer.append(hf_tokens / sec_h)
            same = [a == b for a, b in zip(comps_e, comps_h)]
            equal.append(sum(same))
            if first_bad is None and not all(same):
                i = same.index(False)
                a, b = comps_e[i], comps_h[i]
                j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                first_bad = dict(prompt=i, position=j, engine=a[max(0, j - 2):j + 3], hf=b[max(0, j - 2):j + 3])
            log(f"  {name} threads={threads} run {r + 1}: engine {eng[-1]:6.1f} tok/s, HF {peer[-1]:6.1f} tok/s "
                f"({sum(same)}/{len(same)} completions equal)")
        row = dict(threads=threads, engine_tok_s=_summary(eng), hf_tok_s=_summary(peer),
                   ratio=statistics.median(eng) / statistics.median(peer),
                   ratio_per_run=[round(a / b, 3) for a, b in zip(eng, peer)],
                   engine_output_tokens=eng_tokens, hf_output_tokens=hf_tokens,
                   completions_equal_hf=f"{min(equal)}/{len(prompts)}", first_mismatch=first_bad,
                   loadavg_before=[round(x, 2) for x in load_before],
                   loadavg_after=[round(x, 2) for x in os.getloadavg()], num_runs=len(eng),
                   cell_seconds=round(time.perf_counter() - started, 1))
        rec["rows"].append(row)
        if on_row is not None:
            on_row(rec)
        log(f"{name} threads={threads}: engine {row['engine_tok_s']['median']:.1f} "
            f"[{row['engine_tok_s']['min']:.1f}, {row['engine_tok_s']['max']:.1f}] tok/s, HF "
            f"{row['hf_tok_s']['median']:.1f} [{row['hf_tok_s']['min']:.1f}, {row['hf_tok_s']['max']:.1f}] tok/s, "
            f"ratio {row['ratio']:.2f}x, load {row['loadavg_before']}")
    return rec


def main(args) -> int:
    warnings.filterwarnings("ignore")
    from nanovllm_models import download
    path = args.model or str(download.ensure_model("smollm2"))
    threads_list = list(args.threads)              # already checked by the parser (cli.py)
    repeats = args.repeats

    def log(msg):
        print(msg, flush=True)

    import transformers
    engine_args = dict(device="cpu", dtype="float32",
                       max_model_len=min(2048, transformers.AutoConfig.from_pretrained(path).max_position_embeddings))
    for name in ("kvcache_block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name):
            engine_args[name] = getattr(args, name)
    if args.backends not in ("auto", None):
        engine_args["attention_backend"] = args.backends
    result = dict(tag=args.tag or f"cpu_{os.cpu_count()}core_{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}",
                  date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  machine=dict(device="cpu", cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                               torch=torch.__version__, transformers=transformers.__version__,
                               python=platform.python_version(), loadavg_start=[round(x, 2) for x in os.getloadavg()]),
                  model=("SmolLM2-135M-Instruct" if args.model is None else os.path.basename(path.rstrip("/")))
                  + ", float32", peer="HF transformers generate, one left-padded batch, greedy",
                  method=f"engine and HF interleaved in one process; median of {repeats} runs, min and max",
                  workloads=[])
    engine = EnginePeer(path, **engine_args)
    hf = HFPeer(path)
    result["engine"] = dict(engine.info, engine_args=engine_args)
    log(f"engine: {engine.info}")
    eos = sorted(engine.llm.config.eos)
    # A model with a short context (the tests' tiny checkpoints) keeps each prompt's last tokens.
    limit = engine.llm.config.max_model_len - max(64, args.max_tokens_eos)
    chat8 = [p[-limit:] for p in _chat_ids(engine.llm.tokenizer, QUESTIONS)]
    chat32 = [p[-limit:] for p in _chat_ids(engine.llm.tokenizer, chat32_questions())]
    t0 = time.perf_counter()
    result["targets"] = {"chat8": 1.2, "chat32_eos": 1.5}
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"{result['tag']}.json")

    def save(partial):
        """Write the record as it stands (after every cell, so a run cut short still leaves its numbers)."""
        for w in result["workloads"] + ([partial] if partial is not None else []):
            for row in w["rows"]:
                row["target_ratio"] = result["targets"][w["name"]]
                row["target_met"] = row["ratio"] >= row["target_ratio"]
        rec = dict(result, workloads=result["workloads"] + ([partial] if partial is not None else []))
        rec["bench_seconds"] = round(time.perf_counter() - t0, 1)
        rec["machine"] = dict(result["machine"], loadavg_end=[round(x, 2) for x in os.getloadavg()])
        with open(out, "w") as f:
            json.dump(rec, f, indent=2)
        return rec

    try:
        for name, prompts, n, stop in (("chat8", chat8, 64, None), ("chat32_eos", chat32, args.max_tokens_eos, eos)):
            if name in args.workloads:
                result["workloads"].append(run_workload(name, engine, hf, prompts, n, stop, threads_list, repeats,
                                                        log, budget_s=args.budget_s or None, on_row=save))
    finally:
        engine.exit()
    result = save(None)
    log(f"wrote {out}")
    log(markdown_table(result))
    return 0


def markdown_table(result) -> str:
    lines = ["| workload | threads | nanovllm_ref tok/s (min-max) | HF generate tok/s (min-max) | ratio | load avg |",
             "|---|---|---|---|---|---|"]
    for w in result["workloads"]:
        for r in w["rows"]:
            e, h = r["engine_tok_s"], r["hf_tok_s"]
            lines.append(f"| {w['name']} | {r['threads']} | {e['median']:.1f} ({e['min']:.1f}-{e['max']:.1f}) | "
                         f"{h['median']:.1f} ({h['min']:.1f}-{h['max']:.1f}) | {r['ratio']:.2f}x | "
                         f"{r['loadavg_before'][0]:.2f} |")
    return "\n".join(lines)
