"""CUDA graphs for decode: capture once per batch size, replay every step (chapter 10).

A decode step of a small model is hundreds of tiny kernels; launching them one by one from Python costs
more than running them. A CUDA graph records the whole step once and replays it with one launch. The
graph reads and writes fixed addresses, so each step's inputs are copied into static buffers first, and a
batch is padded up to the next captured size: padding rows write their K/V to no slot (-1), have context
length 0 and block tables of -1, so they change nothing. Upstream nano-vllm: `ModelRunner.capture_cudagraph`
and `run_model`.

What one captured step holds, and why (a "thin" step: the host does as little per step as it can):
- The static inputs are views of ONE int32 device buffer (ids, positions, slots, context lengths,
  temperatures as raw fp32 bits, block tables), filled by ONE copy from a pinned host twin
  (`StaticDecodeInputs`: `pack` copies the step's batch record, engine/step_batch.StepBatch, into the host
  twin, `upload` sends it), instead of six tiny host-to-device copies and the eight small kernels of
  `fill_static_inputs` (the readable form of the same thing, chapter 10's E10.2), each of which costs more
  host time than the bytes it moves. Whoever prepared the record (the reference prepare_decode or a part of
  yours) does not matter: it is plain host data either way.
- With `sample=True` (one process, the reference sampler) the graph also runs the LM head and the sampler:
  the step ends with token ids in a static buffer, and the logits stay in another for samplers that run
  outside (top-k/top-p, min_tokens, penalties and min_p, a replaced sampler) and for logprobs. The
  sampler's random numbers are counter-based (a hash of each row's seed and token index, layers/sampler.py),
  so a replay draws fresh noise for every new token with no generator state inside the graph.
With tensor parallelism the LM head gathers logits across ranks, so there the graph stops at the hidden
states and the LM head and sampler run after it.
"""
import numpy as np
import torch

from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16, and max_num_seqs itself, so any batch size up
    to max_num_seqs pads to a captured graph with at most 15 idle rows."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def resolve_pending(input_ids: torch.Tensor, prev_rows: torch.Tensor, last_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B] int64, prev_rows [B] int (-1 = input_ids holds the token), last_ids [R] int64 (the previous
    step's sampled ids). Returns [B] int64: last_ids[prev_rows] where prev_rows >= 0, else input_ids. No host
    sync, so it runs inside a CUDA graph."""
    return torch.where(prev_rows >= 0, last_ids[prev_rows.long().clamp(min=0)], input_ids)


def fill_static_inputs(buffers: dict, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> None:
    """Copy one decode step's inputs (batch B) into the captured graph's static buffers (max batch ≥ B).
    Rows B.. are padding: slot -1 (write nothing), context length 0, block table -1; the block-table
    columns past this step's width are cleared too, so no stale block id of an earlier step survives.
    (Chapter 10's E10.2. The engine does the same with one packed copy: StaticDecodeInputs.)"""
    batch = input_ids.shape[0]
    buffers["input_ids"][:batch] = input_ids
    buffers["positions"][:batch] = positions
    buffers["slot_mapping"].fill_(-1)
    buffers["slot_mapping"][:batch] = meta.slot_mapping
    buffers["context_lens"].zero_()
    buffers["context_lens"][:batch] = meta.context_lens
    buffers["block_tables"].fill_(-1)
    buffers["block_tables"][:batch, :meta.block_tables.shape[1]] = meta.block_tables


def record_graph(step, pool):
    """Capture `step()` (no arguments) as a CUDA graph after running it once eagerly (the warm-up: compiles and
    allocator growth happen outside the graph). pool: the memory pool to capture into, or None for a new one.
    Returns (the graph, the pool the next graph of the same set shares: graphs of one set never run at once)."""
    graph = torch.cuda.CUDAGraph()
    step()
    with torch.cuda.graph(graph, pool):
        step()
    torch.cuda.synchronize()
    return graph, (graph.pool() if pool is None else pool)


class PinnedInputs:
    """Named int32 fields laid out one after another in ONE device buffer, with a pinned host twin: a step
    writes its inputs into the host twin and sends them with one copy (`upload`), not one copy per tensor.

    sizes: field name -> length, in layout order. `views(buf)` names the slices of either buffer (numpy for the
    host's); `host_views` / `device_views` are those of the two. The host buffer is the source of a
    non-blocking copy, so a writer calls `wait_for_last_copy()` before it overwrites it."""

    def __init__(self, sizes: dict, device):
        self.sizes = dict(sizes)
        size = sum(self.sizes.values())
        self.device_buf = torch.zeros(size, dtype=torch.int32, device=device)
        self.host_buf = torch.zeros(size, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        self.host = self.host_buf.numpy()
        self.device_views = self.views(self.device_buf)
        self.host_views = self.views(self.host)
        self._copied = torch.cuda.Event() if self.host_buf.is_pinned() else None   # the last upload's end

    def views(self, buf) -> dict:
        out, start = {}, 0
        for name, n in self.sizes.items():
            out[name] = buf[start:start + n]
            start += n
        return out

    def upload(self, part: np.ndarray) -> None:
        """One host -> device copy of `part`: the head of the host buffer (what a `pack` returned), here or on
        rank 0 (then it is first written into this buffer's head)."""
        n = len(part)
        if not np.may_share_memory(part, self.host):
            self.wait_for_last_copy()
            self.host[:n] = part
        self.device_buf[:n].copy_(self.host_buf[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def wait_for_last_copy(self) -> None:
        """The host buffer is the source of a non-blocking copy: do not overwrite it before that copy ran."""
        if self._copied is not None:
            self._copied.synchronize()


class StaticDecodeInputs(PinnedInputs):
    """The decode graphs' inputs as one int32 buffer on the device and its pinned twin on the host.

    Layout, for capacity M = max batch and W = max blocks per sequence (each field a slice of length M,
    the block tables M * W, last): input_ids, positions, slot_mapping, context_lens, temperatures (fp32
    bits), seeds (uint32 bits: each row's sampling seed), prev_rows (async scheduling: the row of the
    previous step's sampled ids that holds this row's input token, or -1 when input_ids has it),
    block_tables [M, W]. `views(buf)` names the slices of either buffer. `pack(batch, padded)` writes one
    step's batch record into the host buffer and returns the part a step of `padded` rows reads: the small
    fields and the first `padded` block-table rows (numpy; what tensor-parallel workers receive).
    `upload(part)` copies such a part to the device in one non-blocking copy."""

    FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens", "temperatures", "seeds", "prev_rows")

    def __init__(self, max_bs: int, max_blocks: int, device):
        self.max_bs, self.max_blocks = max_bs, max_blocks
        super().__init__(dict({name: max_bs for name in self.FIELDS}, block_tables=max_bs * max_blocks), device)
        self.host_views["block_tables"][:] = -1

    def views(self, buf) -> dict:
        out = super().views(buf)
        out["block_tables"] = out["block_tables"].reshape(self.max_bs, self.max_blocks)
        host = isinstance(buf, np.ndarray)
        out["temperatures"] = out["temperatures"].view(np.float32 if host else torch.float32)
        if host:                                  # seeds are in [0, 2**32); the device reads the same bits
            out["seeds"] = out["seeds"].view(np.uint32)
        return out

    def pack(self, batch, padded: int) -> np.ndarray:
        """Write the decode step `batch` (engine/step_batch.StepBatch, B rows) into rows 0..B-1 of the host
        buffer and padding into rows B..padded-1 (slot -1, context 0, block table -1); returns the part of the
        buffer a step of `padded` rows reads (a view). Raises ValueError if a block table is wider than the
        graphs were captured for."""
        self.wait_for_last_copy()
        h, step, rows = self.host_views, batch.inputs, batch.sampling
        meta = step.metadata
        b = int(step.input_ids.shape[0])
        tables = meta.block_tables.numpy()
        width = tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"a sequence holds {width} blocks, more than the {self.max_blocks} the captured "
                             "graphs were sized for (max_model_len / block_size)")
        np.maximum(step.input_ids.numpy(), 0, out=h["input_ids"][:b], casting="unsafe")  # PENDING (-1): on device
        h["positions"][:b] = step.positions.numpy()
        h["slot_mapping"][:b] = meta.slot_mapping.numpy()
        h["context_lens"][:b] = meta.context_lens.numpy()
        h["temperatures"][:b] = rows.temperatures
        h["seeds"][:b] = rows.seeds
        h["prev_rows"][:b] = -1 if batch.prev_rows is None else batch.prev_rows
        h["block_tables"][:b, :width] = tables
        h["block_tables"][:b, width:] = -1
        if padded > b:
            for name in ("input_ids", "positions", "context_lens", "temperatures", "seeds"):
                h[name][b:padded] = 0
            h["slot_mapping"][b:padded] = -1
            h["prev_rows"][b:padded] = -1
            h["block_tables"][b:padded] = -1
        return self.host[:len(self.FIELDS) * self.max_bs + padded * self.max_blocks]


class CapturedSizes:
    """The part a set of CUDA graphs captured at several sizes shares (the decode graphs by batch size, the
    prefill graphs by token count): a subclass sets `sizes` (sorted), `graphs` = {} and defines `_step(size)`,
    the step a graph records, then calls `_capture()`: largest first, so the smaller graphs fit in the memory
    pool the largest one made. Tests on a CPU override `_record` to replay `_step` eagerly."""

    def padded_size(self, n: int) -> int | None:
        """The captured size a step of `n` rows or tokens runs in (the smallest that fits), or None."""
        return next((size for size in self.sizes if size >= n), None)

    @torch.inference_mode()
    def _capture(self):
        pool = None
        for size in reversed(self.sizes):
            self.graphs[size], pool = self._record(size, pool)

    def _record(self, size: int, pool):
        """Capture the step of `size`; returns (an object with .replay(), the memory pool to share)."""
        return record_graph(lambda: self._step(size), pool)

    def replay(self, n: int) -> int:
        """Replay the graph for a step of `n` rows or tokens whose inputs are already in the static buffers.
        Returns the padded size that ran."""
        size = self.padded_size(n)
        self.graphs[size].replay()
        return size

    def release(self):
        self.graphs, self.buffers, self.model = {}, {}, None


class CUDAGraphRunner(CapturedSizes):
    """Decode graphs of one model, one per size in `sizes` (largest first, sharing one memory pool).

    model: called as model(input_ids, positions) -> hidden [B, hidden], with `compute_logits(hidden)`;
    max_blocks: the widest block table (max_model_len / block_size rounded up); sample_rows: when given, the
    graph also computes logits and ids = sample_rows(logits, temperatures) (the reference sampler's row
    function) into `token_ids`; else it stops at the hidden states. token_ids: [>= max size] int64, the
    engine's buffer of the last step's sampled ids (the model runner's `last_ids`): rows with prev_rows >= 0
    read their input token from it. `run` returns None for a batch larger than every graph."""

    def __init__(self, model, sizes: list[int], max_blocks: int, hidden_size: int, dtype, device,
                 sample_rows=None, vocab_size: int | None = None, token_ids: torch.Tensor | None = None):
        self.model, self.sizes = model, sorted(sizes)
        self.sample_rows = sample_rows
        max_bs = self.sizes[-1]
        self.inputs = StaticDecodeInputs(max_bs, max_blocks, device)
        v = self.inputs.device_views
        self.buffers = dict(
            input_ids=v["input_ids"], positions=v["positions"], slot_mapping=v["slot_mapping"],
            context_lens=v["context_lens"], block_tables=v["block_tables"], temperatures=v["temperatures"],
            seeds=v["seeds"], prev_rows=v["prev_rows"],
            token_ids=token_ids if token_ids is not None else torch.zeros(max_bs, dtype=torch.int64, device=device),
            outputs=torch.zeros(max_bs, hidden_size, dtype=dtype, device=device))
        if sample_rows is not None:
            self.buffers["logits"] = torch.zeros(max_bs, vocab_size, dtype=dtype, device=device)
        self.graphs = {}
        self._capture()

    def _step(self, bs: int) -> None:
        g = self.buffers
        meta = AttentionMetadata(is_prefill=False, slot_mapping=g["slot_mapping"][:bs],
                                 context_lens=g["context_lens"][:bs], block_tables=g["block_tables"][:bs])
        # int32 in the packed buffer; the model's contract is int64 ids and positions. A row whose input token
        # was sampled by the previous step (async scheduling) reads it from that step's ids, on the device.
        ids = resolve_pending(g["input_ids"][:bs].long(), g["prev_rows"][:bs], g["token_ids"])
        with attention_metadata(meta):
            hidden = self.model(ids, g["positions"][:bs].long())
        g["outputs"][:bs] = hidden
        if self.sample_rows is not None:
            logits = self.model.compute_logits(hidden)
            g["logits"][:bs] = logits
            # A fresh tensor, not the view into the packed int32 buffer: the compiled sampler then sees the
            # same kind of input as in a prefill step and needs no variant of its own.
            temperatures = g["temperatures"][:bs].clone()
            # The token sampled is the sequence's next one: its index is the input's position + 1.
            g["token_ids"][:bs] = self.sample_rows(logits, temperatures, seeds=g["seeds"][:bs].long() & 0xFFFFFFFF,
                                                   counters=g["positions"][:bs].long() + 1)
