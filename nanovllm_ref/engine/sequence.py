"""One completion as the engine sees it (chapter 05/07). Follows upstream nano-vllm `engine/sequence.py`.

A Sequence holds its token ids (prompt then completion), its block table (the physical KV-cache blocks that
hold its keys and values, in order) and how many of its tokens already have K/V in the cache
(`num_cached_tokens`). The scheduler moves it WAITING -> RUNNING -> FINISHED, and back to WAITING on
preemption.

A request with SamplingParams.n > 1 has n sequences (`index` 0..n-1, one `request_id`). Only the first is
queued; the others wait in its `forks` list until its prompt is prefilled, then share its KV blocks
(Scheduler.postprocess, BlockManager.fork). The engine gives each sequence an IncrementalDetokenizer
(`detokenizer`) for its text; a Sequence made without one (tests, the course's checks) has token ids only.
"""
from copy import copy
from enum import Enum, auto
from itertools import count

from nanovllm_ref.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], block_size: int, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, index: int = 0, detokenizer=None):
        sampling_params = sampling_params or SamplingParams()
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        # Tokens whose K/V are in the cache: a prefix-cache hit, then each computed prefill chunk.
        self.num_cached_tokens = 0
        # How many leading blocks already carry their prefix hash (see BlockManager.hash_blocks).
        self.num_hashed_blocks = 0
        # Tokens this step computes (set by the scheduler, read by the model runner).
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        self.temperature = sampling_params.temperature
        self.top_k = sampling_params.top_k            # 0 = off
        self.top_p = sampling_params.top_p            # 1.0 = off
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.min_tokens = sampling_params.min_tokens
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.sampling_params = sampling_params
        self.request_id, self.index = request_id, index
        self.detokenizer = detokenizer                 # engine/detokenizer.py, or None (no text)
        # The sibling samples (n > 1) that fork from this one once its prompt is prefilled.
        self.forks: list["Sequence"] = []
        # Why it finished, as in vLLM: "stop" (eos, a stop id or a stop string), "length" (max_tokens or
        # max_model_len), "abort" (abort_request). stop_reason: the stop id or string (None for eos).
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # The last token was a stop token whose text stays out of the completion's text.
        self.hide_last_token_text = False

    def __len__(self):
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token of the sequence."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def is_prefilling(self) -> bool:
        """True while some tokens before the last one still lack K/V (a prompt, or a recompute after
        preemption). A decode step computes exactly the last token."""
        return self.num_cached_tokens < self.num_tokens - 1

    def block(self, i: int) -> list[int]:
        """Token ids held by logical block i."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1
