"""Start-up warm-up: meet every kernel variant and compiled shape before the first request (chapter 11).

Two kinds of one-time work hide in the first steps of an engine that has not been warmed:
- Triton compiles a kernel the first time it meets a new set of compile-time constants. The prefill
  kernel has two (with and without a cached prefix in the paged cache); integer arguments that change from
  step to step are marked `do_not_specialize` in nanovllm_ref/kernels, so sizes alone never recompile.
- torch.compile (the fused RMSNorm / RoPE / SiLU-and-mul and the sampler's row function, utils/fusion.py)
  compiles once per variant: with dynamic shapes, a size of 1 is still specialised, so batch 1 and
  "any other size" are two compiles, and the sampler's row function has one variant without and one with
  top-k/top-p filters, and one per logits dtype: the model's, and fp32 (the logits processors, penalties
  and min_p, hand it fp32 logits).
Measured on the H200 before this module: one prefill step of the benchmark took 1.02 s the first time and
0.06 s the second. A benchmark's timed run should not pay for compiles, and neither should a user's first
request, so the model runner calls `warm_step_variants` once at start-up, after the KV cache and the CUDA
graphs exist: a few tiny steps that cover the variants above.

The warm-up steps write K/V into block 0 of the cache. That is harmless: the block manager does not exist
yet, and every block's K/V is written by its owner's prefill before anything reads it. Every rank runs the
same steps (the collectives line up); only rank 0 samples. The sampler's random numbers are counter-based
(layers/sampler.py), so the warm-up's draws change nothing that a request later draws.
"""
import torch

from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.engine.step_batch import StepBuilder
from nanovllm_ref.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.6)
FILTERED = SamplingParams(temperature=0.6, top_k=20, top_p=0.9)


def _seq(num_tokens: int, cached: int, block_size: int, sp: SamplingParams) -> Sequence:
    """A sequence of `num_tokens` tokens, the first `cached` of them already in the cache, every block
    mapped to block 0; the rest (or, for decode, the last token) scheduled."""
    seq = Sequence([1 + i % 7 for i in range(num_tokens)], block_size, sp)
    seq.block_table = [0] * ((num_tokens + block_size - 1) // block_size)
    seq.num_cached_tokens = cached
    seq.num_scheduled_tokens = num_tokens - cached
    return seq


def step_variants(block_size: int, decode_eager: bool) -> list[tuple[list[tuple[int, int]], bool]]:
    """The model steps of the warm-up as (sequences as (num_tokens, num_cached), is_prefill) pairs: prefill
    with no cached prefix and with one (a chunk continuation or a prefix-cache hit), for one sequence and
    for two, of one token and of several; eager decode at batch 1 and 2 when no CUDA graph runs decode."""
    steps = [
        ([(1, 0)], True),                                      # 1-token prefill: size-1 specialisations
        ([(3, 0)], True),
        ([(3, 0), (5, 0)], True),
        ([(4, 2)], True),                                      # cached prefix: the paged-prefill kernel
        ([(4, 3), (6, 2)], True),
    ]
    if decode_eager:
        steps += [([(5, 4)], False), ([(5, 4), (6, 5)], False)]
    return steps


PROCESSED = SamplingParams(temperature=0.6, repetition_penalty=1.1, min_p=0.05)
SAMPLER_VARIANTS = [(n, sp) for n in (1, 2) for sp in (SAMPLED, FILTERED, PROCESSED)]


@torch.inference_mode()
def warm_step_variants(runner) -> int:
    """Run the model steps of `step_variants` on `runner` (a ModelRunner, this rank only: `execute` of a
    message it prepared itself), greedy, then, on rank 0, the sampling step's variants (`SAMPLER_VARIANTS`:
    sampled, filtered, and with logits processors, one row and two) on random logits of the model's dtype.
    The sampler is warmed apart because only rank 0 samples: a compile there between two model steps would
    keep the other ranks waiting inside a collective (and NCCL's watchdog aborts after its timeout); after
    the model steps they wait for rank 0's next message instead. Returns the number of steps run."""
    steps = step_variants(runner.block_size, decode_eager=runner.graph_runner is None)
    builder = StepBuilder(runner.plan.prepare_prefill, runner.plan.prepare_decode, runner.config)
    sizes = [(n, sp) for n, sp in SAMPLER_VARIANTS] + [(n, SAMPLED) for n in row_draw_sizes(runner)]
    for specs, is_prefill in steps:
        seqs = [_seq(n, cached, runner.block_size, GREEDY) for n, cached in specs]
        batch = builder.build(seqs, is_prefill)
        logits, _, _ = runner.execute(runner.message(batch))
        if runner.rank == 0:
            runner.sample(batch, logits, None)
    if runner.rank == 0:
        vocab = runner.config.hf_config.vocab_size
        for n, sp in sizes:
            seqs = [_seq(2, 1, runner.block_size, sp) for _ in range(n)]
            batch = builder.build(seqs, False)
            logits = torch.randn(n, vocab, device=runner.device).to(runner.dtype)
            runner.sample(batch, logits, None, runner.processing(batch)).token_ids()
    if runner.device_type == "cuda":
        torch.cuda.synchronize(runner.device)
    return len(steps) + (len(sizes) if runner.rank == 0 else 0)


def row_draw_sizes(runner) -> list[int]:
    """Batch sizes at which the sampler's row draw after the graph compiles its other variants: the Triton
    kernel (kernels/sampler.py) splits a row into 1..32 vocabulary slices by batch size, and its merge
    kernel compiles once per power of two (the graphs' own draws warm those at the captured sizes, but a
    step that samples after the graph may have any size). None off CUDA or with the compiled draw."""
    if runner.device_type != "cuda" or not runner.plan.sample_rows_name.startswith("Triton"):
        return []
    from nanovllm_ref.kernels.sampler import num_slices
    vocab, seen, sizes = runner.config.hf_config.vocab_size, set(), []
    for n in range(3, runner.config.max_num_seqs + 1):
        s = num_slices(n, vocab, runner.device)
        if s not in seen:
            seen.add(s)
            sizes.append(n)
    return sizes
