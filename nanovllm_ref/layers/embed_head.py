"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks (chapter 09).

Rank r holds rows [r * V/tp, (r + 1) * V/tp) of the [vocab, hidden] table. For the embedding, each rank
looks up the ids it owns, writes zeros for the others, and an all-reduce fills in the rest. For the LM head,
each rank computes its slice of the logits and rank 0 gathers them (only rank 0 samples).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm_ref.utils.onednn import linear
from nanovllm_ref.utils.parallel import all_reduce, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.shard = num_embeddings // self.tp_size
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if loaded_weight.shape != (self.shard * self.tp_size, param.shape[1]):
            raise RuntimeError(f"expected shape {(self.shard * self.tp_size, param.shape[1])}, "
                               f"got {tuple(loaded_weight.shape)}")
        param.data.copy_(loaded_weight.narrow(0, self.start, self.shard))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] int64 -> [num_tokens, hidden]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.shard)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    USES_ONEDNN_LINEAR = True          # utils/onednn.pack gives its weight a oneDNN copy on CPU

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states: [num_seqs, hidden] -> logits [num_seqs, vocab] on rank 0, None on other ranks."""
        logits = linear(hidden_states, self.weight)          # F.linear (oneDNN on CPU)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None
