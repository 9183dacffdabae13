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


# Async scheduling (engine/llm_engine.py): the id held in a sequence for a token that a step still in flight
# samples, until its value reaches the host. Never a real token id; never fed to the model (the device reads
# the real id from the step's output instead).
PENDING = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


def request_seed(seed: int, index: int = 0) -> int:
    """The [0, 2**32) stream seed of sample `index` of a request with SamplingParams.seed `seed` (any int in
    [-2**63, 2**64), taken mod 2**64 as torch.manual_seed does): SplitMix64's finaliser (Steele et al.,
    OOPSLA 2014) over seed + index * golden ratio, so nearby or sign-flipped seeds give unrelated streams;
    two different seeds share one only by chance (2**-32 a pair)."""
    z = (int(seed) + (index + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], block_size: int, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, index: int = 0, detokenizer=None, seed: int | None = None):
        sampling_params = sampling_params or SamplingParams()
        self.seq_id = next(Sequence._ids)
        # The seed of this sequence's random numbers, in [0, 2**32) (layers/sampler.py): the request's own
        # (each of n samples mixing in its index), else the one the engine drew for it, else one made from
        # the sequence id.
        if sampling_params.seed is not None:
            # Through a full 64-bit mix: xor-folding the halves sent 0 and -1 (and 1 and 2**32) to one stream.
            self.seed = request_seed(sampling_params.seed, index)
        else:
            if seed is None:
                seed = self.seq_id * 0x9E3779B1
            seed = int(seed) % 2**64
            self.seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF
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
        # Logits processors (layers/logits_processors.py): a penalty of any kind, and min_p (0 = off).
        self.penalized = (sampling_params.presence_penalty != 0 or sampling_params.frequency_penalty != 0
                          or sampling_params.repetition_penalty != 1)
        self.min_p = sampling_params.min_p
        # Logprobs (layers/logprobs.py): top-n per completion token (None = off), and, for the first sample
        # only (the request has one prompt), the prompt's. Raw rows as they arrive from the device:
        # (token ids, logprobs, rank of the first id), column 0 the chosen token.
        self.num_logprobs = sampling_params.logprobs
        self.num_prompt_logprobs = sampling_params.prompt_logprobs if index == 0 else None
        self.logprobs: list[tuple[list[int], list[float], int]] = []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[tuple[list[int], list[float], int]] = []     # for prompt tokens 1, 2, ...
        # Prompt positions whose logits a launched step computes for prompt logprobs (the model runner
        # moves it on at launch; position p gives token p + 1's logprob).
        self.num_prompt_logprobs_launched = 0
        self.sampling_params = sampling_params
        # A setting beyond temperature and seed (filters, min_p, penalties, min_tokens, logprobs): the step's
        # sampling rows look at this sequence one setting at a time (engine/sampling_inputs.py).
        self.special = ((self.temperature > 0 and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0))
                        or self.penalized or self.min_tokens > 0 or self.num_logprobs is not None)
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
        # Async scheduling: trailing PENDING ids, and the output row of the step that samples the last one.
        self.num_pending = 0
        self.pending_row = -1

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
        """The completion's token ids known on the host (async scheduling: without the pending ones)."""
        return self.token_ids[self.num_prompt_tokens:self.num_tokens - self.num_pending]

    @property
    def num_known_completion_tokens(self) -> int:
        """Completion tokens whose value is known (num_completion_tokens counts the pending ones too)."""
        return self.num_completion_tokens - self.num_pending

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while some prompt position's logits are still to be computed for prompt_logprobs. Such a
        sequence takes no prefix-cache hit (a cached prefix has K/V but no logits: vLLM recomputes it too)."""
        return self.num_prompt_logprobs is not None and self.num_prompt_logprobs_launched < self.num_prompt_tokens - 1

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

    def append_pending(self, row: int) -> None:
        """Async scheduling: the step just launched samples this sequence's next token in output row `row`.
        Hold its place (lengths, positions and blocks move on now); `fill_pending` writes the value."""
        self.append_token(PENDING)
        self.num_pending += 1
        self.pending_row = row

    def fill_pending(self, token_id: int) -> None:
        """The oldest pending token's value arrived from the device."""
        self.token_ids[self.num_tokens - self.num_pending] = token_id
        self.num_pending -= 1
        if self.num_pending == 0:
            self.last_token = token_id
            self.pending_row = -1

    def drop_pending(self) -> None:
        """Forget pending tokens (the sequence finished before they were needed)."""
        if self.num_pending:
            del self.token_ids[self.num_tokens - self.num_pending:]
            self.num_tokens -= self.num_pending
            self.num_pending, self.pending_row = 0, -1
            self.last_token = self.token_ids[-1]
