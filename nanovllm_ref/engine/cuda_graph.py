"""CUDA graphs for decode: capture once per batch size, replay every step (chapter 10).

A decode step of a small model is hundreds of tiny kernels; launching them one by one from Python costs
more than running them. A CUDA graph records the whole forward once and replays it with one launch. The
graph reads and writes fixed addresses, so each step's inputs are copied into static buffers first, and a
batch is padded up to the next captured size: padding rows write their K/V to no slot (-1), have context
length 0 and block tables of -1, so they change nothing. Upstream nano-vllm: `ModelRunner.capture_cudagraph`
and `run_model`.
"""
import torch

from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16, and max_num_seqs itself, so any batch size up
    to max_num_seqs pads to a captured graph with at most 15 idle rows."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def fill_static_inputs(buffers: dict, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> None:
    """Copy one decode step's inputs (batch B) into the captured graph's static buffers (max batch ≥ B).
    Rows B.. are padding: slot -1 (write nothing), context length 0, block table -1; the block-table
    columns past this step's width are cleared too, so no stale block id of an earlier step survives."""
    batch = input_ids.shape[0]
    buffers["input_ids"][:batch] = input_ids
    buffers["positions"][:batch] = positions
    buffers["slot_mapping"].fill_(-1)
    buffers["slot_mapping"][:batch] = meta.slot_mapping
    buffers["context_lens"].zero_()
    buffers["context_lens"][:batch] = meta.context_lens
    buffers["block_tables"].fill_(-1)
    buffers["block_tables"][:batch, :meta.block_tables.shape[1]] = meta.block_tables


class CUDAGraphRunner:
    """Decode graphs of one model, one per size in `sizes` (largest first, sharing one memory pool).

    model: called as model(input_ids, positions) -> hidden [B, hidden]; max_blocks: the widest block table
    (max_model_len / block_size rounded up). `run` returns None for a batch larger than every graph."""

    def __init__(self, model, sizes: list[int], max_blocks: int, hidden_size: int, dtype, device):
        self.model, self.sizes = model, sorted(sizes)
        max_bs = self.sizes[-1]
        self.buffers = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int32, device=device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=device),
            block_tables=torch.full((max_bs, max_blocks), -1, dtype=torch.int32, device=device),
            outputs=torch.zeros(max_bs, hidden_size, dtype=dtype, device=device))
        self.graphs = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self):
        g, pool = self.buffers, None
        for bs in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            meta = AttentionMetadata(is_prefill=False, slot_mapping=g["slot_mapping"][:bs],
                                     context_lens=g["context_lens"][:bs], block_tables=g["block_tables"][:bs])
            with attention_metadata(meta):
                g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs])     # warm-up
                with torch.cuda.graph(graph, pool):
                    g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs])
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Replay the smallest graph that fits this batch; returns hidden states [B, hidden], or None."""
        batch = input_ids.shape[0]
        bs = next((b for b in self.sizes if b >= batch), None)
        if bs is None:
            return None
        fill_static_inputs(self.buffers, input_ids, positions, meta)
        self.graphs[bs].replay()
        return self.buffers["outputs"][:batch]

    def release(self):
        self.graphs, self.buffers, self.model = {}, {}, None
