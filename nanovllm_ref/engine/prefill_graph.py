"""CUDA graphs for prefill: capture once per token count, replay every small prefill step (chapter 10).

Why: a served request usually arrives alone, so its prefill step is one prompt of a few hundred tokens. Run
eagerly, that step is host-bound like an eager decode step. On the H200 a 564-token prefill of Qwen3-0.6B
took 30-48 ms of host time for 2.5 ms of kernels (`bench/prefill_step.py`; records
bench/results/prefill_step_h200_2026-12-02_baseline.json and prefill_step_h200_2026-12-02.json): 113 cuBLAS
calls at ~68 us of host each, and the compiled element-wise regions at ~0.7 ms a layer (Dynamo's guards and
wrappers for dynamic shapes); 128 tokens cost nearly as much as 4,096. Every request waited that long for its
first token, and every running decode waited with it. Replayed from a graph, the same step takes 4.3 ms
(128 tokens: 2.6 ms; 4,096: 20.7 ms). vLLM captures its piecewise graphs by token count for the same reason.

How: a prefill step of T real tokens over S sequences is padded to the smallest captured token count >= T,
and to S_max sequences (`max_seqs`), and replays that graph. What makes the padding change nothing:
- padded tokens have slot -1 (their K/V is written nowhere) and belong to no sequence, so no query attends
  from them and no key comes from them; their rows of every activation are garbage that no real row reads
  (everything but attention is row-wise);
- padded sequences have zero query and key tokens (cu_seqlens repeat the last value), so the Triton prefill
  kernel's programs for them return at once (its grid is sized for the longest sequence anyway:
  kernels/attention.py, `_prefill_kernel`);
- the graph always reads keys through the block tables (`paged_prefill`), with or without a cached prefix:
  this step's K/V are in the cache before attention runs, and the kernel reads the same values from there as
  from the step's own k/v.
The graph stops at the hidden state of each sequence's last token ([S_max, hidden]); the LM head and the
sampler run after it on the S real rows, as in an eager prefill.

What runs eagerly instead: steps larger than the largest graph, more than `max_seqs` sequences, prompt
logprobs (they need the logits of many rows), and every step where EnginePlan.prefill_graph_sizes is empty
(module docstring of nanovllm_ref/parts.py says when).

The static inputs are one int32 buffer (engine/cuda_graph.PinnedInputs): input_ids, positions, slot_mapping
[T_max], cu_seqlens_q, cu_seqlens_k [S_max + 1], last_rows [S_max] (each sequence's last token's row) and the
block tables [S_max, max_blocks], filled by one copy from its pinned host twin.
"""
import numpy as np
import torch

from nanovllm_ref.engine.cuda_graph import CapturedSizes, PinnedInputs
from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata

# Token counts to capture: a prompt pads by at most half again (and by at most 16 tokens below 32).
_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384,
          24576, 32768, 49152, 65536)
MAX_SEQS = 16


def prefill_graph_sizes(max_tokens: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """The token counts to capture prefill graphs for: those of _SIZES up to max_tokens, and no larger than
    the first one that holds max_num_batched_tokens (a prefill step is never larger). () for max_tokens 0."""
    sizes = []
    for size in _SIZES:
        if size > max_tokens:
            break
        sizes.append(size)
        if size >= max_num_batched_tokens:
            break
    return tuple(sizes)


class StaticPrefillInputs(PinnedInputs):
    """The prefill graphs' inputs (module docstring's layout) for up to `max_tokens` tokens and `max_seqs`
    sequences of up to `max_blocks` blocks each."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        t, s = max_tokens, max_seqs
        super().__init__({"input_ids": t, "positions": t, "slot_mapping": t, "cu_seqlens_q": s + 1,
                          "cu_seqlens_k": s + 1, "last_rows": s, "block_tables": s * max_blocks}, device)
        for views in (self.host_views, self.device_views):
            views["block_tables"] = views["block_tables"].reshape(s, max_blocks)
        self.host_views["block_tables"][:] = -1
        self.host_views["slot_mapping"][:] = -1

    def fits(self, batch) -> bool:
        """Whether the prefill step `batch` (engine/step_batch.StepBatch) can run in these graphs."""
        tables = batch.block_tables
        return (tables is not None and batch.logit_rows is None and batch.num_seqs <= self.max_seqs
                and int(batch.inputs.input_ids.shape[0]) <= self.max_tokens and tables.shape[1] <= self.max_blocks)

    def pack(self, batch) -> np.ndarray:
        """Write the prefill step `batch` into the host buffer, padding included (module docstring); returns
        the buffer (what `upload` copies)."""
        self.wait_for_last_copy()
        h, step = self.host_views, batch.inputs
        meta = step.metadata
        n, s = int(step.input_ids.shape[0]), batch.num_seqs
        cu_q = meta.cu_seqlens_q.numpy()
        h["input_ids"][:n] = step.input_ids.numpy()
        h["positions"][:n] = step.positions.numpy()
        h["slot_mapping"][:n] = meta.slot_mapping.numpy()
        for name in ("input_ids", "positions"):
            h[name][n:] = 0
        h["slot_mapping"][n:] = -1
        h["cu_seqlens_q"][:s + 1] = cu_q
        h["cu_seqlens_q"][s + 1:] = cu_q[-1]
        cu_k = meta.cu_seqlens_k.numpy()
        h["cu_seqlens_k"][:s + 1] = cu_k
        h["cu_seqlens_k"][s + 1:] = cu_k[-1]
        h["last_rows"][:s] = cu_q[1:] - 1
        h["last_rows"][s:] = 0
        tables = batch.block_tables
        h["block_tables"][:s, :tables.shape[1]] = tables
        h["block_tables"][:s, tables.shape[1]:] = -1
        h["block_tables"][s:] = -1
        return self.host


class PrefillGraphRunner(CapturedSizes):
    """Prefill graphs of one model, one per token count in `sizes` (largest first, sharing one memory pool).

    model: called as model(input_ids, positions) -> hidden [T, hidden]; max_blocks: the widest block table
    (max_model_len / block_size rounded up); max_seqs: the most sequences a graph takes; max_seqlen_k: what
    the metadata says of the longest key range (max_model_len; the Triton kernel does not read it).
    `replay(num_tokens)` runs the graph that fits and leaves each sequence's last hidden state in
    buffers["outputs"][:num_seqs]."""

    def __init__(self, model, sizes, max_blocks: int, hidden_size: int, dtype, device, max_seqs: int = MAX_SEQS,
                 max_seqlen_k: int = 0):
        self.model, self.sizes = model, sorted(sizes)
        self.max_seqlen_k = max_seqlen_k
        self.inputs = StaticPrefillInputs(self.sizes[-1], max_seqs, max_blocks, device)
        self.buffers = dict(self.inputs.device_views,
                            outputs=torch.zeros(max_seqs, hidden_size, dtype=dtype, device=device))
        self.graphs = {}
        self.inputs.upload(self.inputs.host)          # all padding: no sequence, no slot, for the warm-up runs
        self._capture()

    def _step(self, t: int) -> None:
        g = self.buffers
        meta = AttentionMetadata(is_prefill=True, cu_seqlens_q=g["cu_seqlens_q"], cu_seqlens_k=g["cu_seqlens_k"],
                                 max_seqlen_q=t, max_seqlen_k=max(self.max_seqlen_k, t),
                                 slot_mapping=g["slot_mapping"][:t], block_tables=g["block_tables"])
        with attention_metadata(meta):
            hidden = self.model(g["input_ids"][:t].long(), g["positions"][:t].long())
        g["outputs"].copy_(hidden[g["last_rows"].long()])
