"""Planted wrong parts for tests/test_course_ch13.py. Module-level (importable, so they pickle into
tensor-parallel workers like a student's exported parts do)."""
import torch

from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.engine.sequence import SequenceStatus
from nanovllm_ref.layers.sampler import SamplingMetadata, sample


class BackOfQueueScheduler(Scheduler):
    """Preempts like the reference but re-queues the victim at the BACK of the waiting queue."""

    def preempt(self, seq):
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.append(seq)


def sample_ignoring_temperature(logits, metadata):
    """Samples every non-greedy row at T = 1, whatever the request asked for."""
    t = torch.where(metadata.temperatures > 0, torch.ones_like(metadata.temperatures), metadata.temperatures)
    return sample(logits, SamplingMetadata(temperatures=t, all_greedy=metadata.all_greedy, top_k=metadata.top_k,
                                           top_p=metadata.top_p))


def store_writing_slot_minus_one(key, value, k_cache, v_cache, slot_mapping):
    """Writes every row, padding rows (slot -1) included: -1 indexes the cache's LAST slot."""
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value


def store_reading_v_with_k_strides(key, value, k_cache, v_cache, slot_mapping):
    """Reads V through K's strides: right while both are contiguous, wrong in the engine, where V is a strided
    view of the fused QKV projection and K is not."""
    from nanovllm_ref.attn.torch_backend import store_kvcache
    store_kvcache(key, value.as_strided(value.shape, key.stride(), value.storage_offset()), k_cache, v_cache,
                  slot_mapping)
