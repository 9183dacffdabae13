""""Your part in the engine": run the tiny Qwen3 engine with a student's functions plugged in through
`nanovllm_ref.Parts`, and compare its greedy ids with HF transformers (ungraded; course machinery).

    from nanovllm_course.engine_check import your_part_in_the_engine
    your_part_in_the_engine(rms_norm=rms_norm, fused_add_rms_norm=fused_add_rms_norm)

The names are those of the notebook's exercise functions (nanovllm_course.export.EXPORTS). Prints one line:
which of your parts ran and how many prompts matched HF, or that the exercise is still a stub, or how the
engine failed. It never raises, so Run All goes on; the graded verdict is the exercise's own check cell.
"""
import warnings

import torch

from nanovllm_course.export import is_stub, parts_from_functions

# Prompts of the tiny model's vocabulary (ids < 512): two share a prefix (a prefix-cache hit with block size 4),
# one is long enough to be chunked under the 16-token budget.
PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 40], [5, 9, 11, 3, 7, 2, 8, 40, 41, 42], [100, 4],
           [7, 13, 21, 34, 55, 89, 144, 233, 377, 10, 20, 30, 40, 50, 60, 70, 80, 90]]
MAX_TOKENS = 8


def _hf_greedy(path: str, prompt: list[int]) -> list[int]:
    from nanovllm_course.ch03 import hf_model
    model = hf_model(path)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def your_part_in_the_engine(**functions) -> bool:
    """Run the engine with `functions` as parts; print one line; return True when every prompt matched HF."""
    from nanovllm_ref import LLM, SamplingParams
    from nanovllm_course.common import tiny_model_dir

    names = ", ".join(functions)
    stubs = [n for n, fn in functions.items() if is_stub(fn)]
    if len(stubs) == len(functions):
        print(f"Your {names}: still {'a stub' if len(stubs) == 1 else 'stubs'}, so the engine would run the "
              "reference. Fill in the exercise, then run this cell again.")
        return False
    parts, used = parts_from_functions(**functions)
    path = tiny_model_dir("qwen3")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(path, parts=parts, kvcache_block_size=4, max_num_batched_tokens=16, max_model_len=64,
                      device="cpu")
            try:
                outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                    use_tqdm=False)
            finally:
                llm.exit()
    except Exception as exc:                          # the student's part broke the engine: say how, briefly
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"The engine with your {', '.join(used)} failed: {type(exc).__name__}: {first[:200]}")
        return False
    matched = sum(o["token_ids"] == _hf_greedy(path, p) for o, p in zip(outs, PROMPTS))
    skipped = f" ({', '.join(stubs)} still the reference's: stub)" if stubs else ""
    if matched == len(PROMPTS):
        verdict = f"greedy ids equal HF transformers' on all {matched} prompts."
    else:
        verdict = (f"greedy ids match HF transformers' on only {matched}/{len(PROMPTS)} prompts; the exercise's "
                   "check cell says what differs.")
    print(f"Your {', '.join(used)} ran inside the engine{skipped}: {verdict}")
    return matched == len(PROMPTS)
