"""A request as the engine tracks it, how one is checked before it is queued, and its output (chapter 07).

A Request is what `add_request` made: an id, the prompt, its SamplingParams and its n sequences (one per
sample; engine/sequence.py). `check_request` validates one prompt and its settings against the tokenizer
and the engine's config without changing anything, so `generate` can check a whole batch before queuing
any of it, and the command line can check its prompts before the weights load. Each refusal is a
RequestError (nanovllm_ref/errors.py) whose `field` names the argument at fault, so the HTTP server names
its own field without restating a rule or reading the message. `load_tokenizer` loads a model folder's
tokenizer and refuses one the model cannot use.
"""
import numbers
import warnings
from collections.abc import Sequence as SequenceABC

from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.engine.stop import completion_text
from nanovllm_ref.errors import RequestError, RequestTypeError
from nanovllm_ref.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm_ref.sampling_params import SamplingParams

# What a request needs from Scheduler.postprocess beyond eos and max_tokens; a Parts.scheduler with its own
# postprocess (chapter 07's exercise) may not do it, so such requests are refused with that scheduler.
POSTPROCESS_FEATURES = ("n", "stop", "stop_token_ids", "min_tokens")
# The most top tokens a request may ask for per position (logprobs, prompt_logprobs): vLLM's default
# max_logprobs. Each one is a dict entry per token on the host.
MAX_LOGPROBS = 20


def load_tokenizer(path: str, vocab_size: int | None = None):
    """The tokenizer of the model folder `path` (transformers' AutoTokenizer). Raises ValueError if there is
    none that works (transformers then builds an empty one, or fails), or, given the model's `vocab_size`
    (config.json), if the tokenizer has more tokens than the embedding table has rows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            reason = " ".join(str(exc).split())      # one line
            raise ValueError(f"could not load a tokenizer from {path!r}: {reason}") from exc
    if len(tokenizer) < 2:
        raise ValueError(f"model folder {path!r} has no usable tokenizer (tokenizer.json / tokenizer_config.json); "
                         "the engine needs one")
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer of {path!r} has {len(tokenizer)} tokens but the model's embedding table has "
                         f"{vocab_size} rows (config.json vocab_size): ids >= {vocab_size} would index past it")
    return tokenizer


def check_text(text: str, where: str) -> None:
    """Raise ValueError naming `where` if `text` is not valid Unicode text: a Python str (and a JSON string,
    through its \\ud800 escapes) can hold a lone surrogate, half of a UTF-16 pair, which no UTF-8 text holds and
    no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where} is not valid text: character {exc.start} is a lone surrogate "
                         f"({text[exc.start]!r}, half of a UTF-16 pair, which UTF-8 cannot encode); send whole "
                         "characters") from None


def encode_text(tokenizer, text: str, where: str = "prompt") -> list[int]:
    """Token ids of the str prompt `text` (tokenizer.encode: its special tokens added). Raises RequestError
    (field "prompt", the message naming `where`) when the text cannot be tokenized: not valid text
    (check_text), or the tokenizer fails."""
    try:
        check_text(text, where)
    except ValueError as exc:
        raise RequestError("prompt", str(exc)) from None
    try:
        return [int(t) for t in tokenizer.encode(text)]
    except Exception as exc:                        # a tokenizer's own failure on this text: the text is at fault
        raise RequestError("prompt", f"{where} could not be tokenized ({type(exc).__name__}: {exc})") from exc


def kv_cache_room(prompt_len: int, max_model_len: int, kv_cache_tokens: int) -> int | None:
    """How many new tokens (max_tokens) a prompt of `prompt_len` tokens may ask for and still fit in a KV cache
    of `kv_cache_tokens` token slots: None if any number fits (max_model_len stops it first), 0 if the prompt
    alone does not fit. The rule check_request applies, and the one the server's max_tokens=None resolves by.

    A request holds K/V for its prompt, then for every sampled token but the last (it is never fed back),
    and stops at max_model_len: longest = max(P, min(P + max_tokens, max_model_len) - 1) tokens, which is
    <= kv_cache_tokens exactly when P fits and max_tokens <= kv_cache_tokens + 1 - P, or
    max_model_len - 1 <= kv_cache_tokens. Blocks round up, and ceil(n / block_size) <= num_blocks exactly
    when n <= num_blocks * block_size, so token slots decide."""
    if prompt_len > kv_cache_tokens:
        return 0
    if max_model_len - 1 <= kv_cache_tokens:
        return None
    return kv_cache_tokens + 1 - prompt_len


def _check_sampling_params(sp, where: str, vocab_size: int, scheduler_cls, block_manager_cls=None,
                           prefix_caching: bool = False) -> None:
    if not isinstance(sp, SamplingParams):
        raise RequestTypeError("sampling_params", f"{where} must be a SamplingParams, got {type(sp).__name__}")
    pending = sp.pending_fields()
    if pending:
        name = pending[0]
        raise RequestError(name, f"{where}: SamplingParams.{name}={getattr(sp, name)!r} is not implemented yet "
                                 f"in nanovllm_ref (accepted for vLLM compatibility); leave it at its default")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sp, name)
        if value is not None and value > MAX_LOGPROBS:
            raise RequestError(name, f"{where}: SamplingParams.{name}={value} asks for more than {MAX_LOGPROBS} "
                                     f"top tokens per position (vLLM's default max_logprobs); use 0..{MAX_LOGPROBS}")
    from nanovllm_ref.parts import is_reference_part, uses_reference_postprocess   # the identity question's home
    if (sp.prompt_logprobs is not None and prefix_caching and block_manager_cls is not None
            and not is_reference_part("block_manager", block_manager_cls)):
        raise RequestError("prompt_logprobs", f"{where}: SamplingParams.prompt_logprobs with prefix caching needs "
                           f"the reference BlockManager (it gives such a request no prefix-cache hit, whose "
                           f"positions would have no logits); Parts.block_manager={block_manager_cls.__name__} has "
                           "its own: pass enable_prefix_caching=False")
    bad = [t for t in sp.stop_token_ids if t >= vocab_size]
    if bad:
        raise RequestError("stop_token_ids", f"{where}: stop_token_ids {bad[:5]} are outside the vocabulary "
                                             f"[0, {vocab_size})")
    if not uses_reference_postprocess(scheduler_cls):
        defaults = SamplingParams()
        used = [f for f in POSTPROCESS_FEATURES if getattr(sp, f) != getattr(defaults, f)]
        if used:
            raise RequestError(used[0], f"{where}: SamplingParams.{used[0]} needs the reference "
                                        f"Scheduler.postprocess (engine/stop.py, forks); "
                                        f"Parts.scheduler={scheduler_cls.__name__} has its own")


def check_request(prompt, sp, *, tokenizer, config, scheduler_cls, where: str = "prompt",
                  sp_where: str = "sampling_params", block_manager_cls=None) -> list[int]:
    """Token ids of one validated request; raises RequestError (a ValueError; RequestTypeError, also a
    TypeError, for a wrong type) whose `field` is the argument at fault ("prompt", or the SamplingParams field)
    and whose message names it (`where`, `sp_where`: how the prompt and its settings are called in the
    message). Changes nothing.

    prompt: a str (encoded with the tokenizer's special tokens; text it cannot encode, such as a lone surrogate,
    is a ValueError) or a list of int token ids. Checks: the ids
    are in [0, vocab_size) (str prompts too: a tokenizer's added tokens can lie past the embedding table),
    the prompt is not empty and fits max_model_len, and (once the cache is sized) the request can ever fit in
    the KV cache. sp: a SamplingParams; refused if it sets a field not implemented yet (PENDING), has stop
    ids outside the vocabulary, n > max_num_seqs, logprobs or prompt_logprobs above MAX_LOGPROBS, a field
    that needs the reference postprocess while Parts.scheduler replaces it, or prompt_logprobs with prefix
    caching while `block_manager_cls` (Parts.block_manager; None = not checked) replaces the reference.
    """
    vocab = config.hf_config.vocab_size
    _check_sampling_params(sp, sp_where, vocab, scheduler_cls, block_manager_cls,
                           getattr(config, "enable_prefix_caching", False))
    if sp.n > config.max_num_seqs:
        raise RequestError("n", f"{sp_where}: n={sp.n} samples cannot run at once with "
                                f"max_num_seqs={config.max_num_seqs}")
    if isinstance(prompt, str):
        token_ids = encode_text(tokenizer, prompt, where)
    elif isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray)):
        if set(map(type, prompt)) <= {int}:
            # The usual prompt, plain ints (a server's JSON body): no per-id isinstance against numbers.Integral,
            # an ABC check that cost ~0.3 ms for a 560-token prompt, twice per served request.
            token_ids = list(prompt)
        else:
            for j, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise RequestTypeError("prompt", f"{where}[{j}] must be an int token id, got {type(t).__name__}")
            token_ids = [int(t) for t in prompt]
    else:
        raise RequestTypeError("prompt", f"{where} must be a str or a list of int token ids, got "
                                         f"{type(prompt).__name__}")
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
        bad = [t for t in token_ids if not 0 <= t < vocab]
        raise RequestError("prompt", f"{where} has token ids outside [0, {vocab}): {bad[:5]}"
                           + (" (the tokenizer made them: it knows more tokens than the model's embedding table)"
                              if isinstance(prompt, str) else ""))
    if not token_ids:
        raise RequestError("prompt", f"{where} is empty; a prompt needs at least one token")
    max_len, n = config.max_model_len, len(token_ids)
    if n > max_len:
        raise RequestError("prompt", f"{where} has {n} tokens, more than max_model_len={max_len}")
    bs, have = config.kvcache_block_size, config.num_kvcache_blocks
    if have > 0:                                      # 0: the cache is not sized yet (before the weights load)
        room = kv_cache_room(n, max_len, have * bs)
        if room == 0:
            raise RequestError("prompt", f"{where} can never fit in the KV cache: its {n} tokens need "
                                         f"{-(-n // bs)} blocks of {bs}, the cache has {have}; shorten it or give "
                                         "the cache more memory")
        if room is not None and sp.max_tokens > room:
            longest = min(n + sp.max_tokens, max_len) - 1
            raise RequestError("max_tokens", f"{where} can never fit in the KV cache: up to {longest} tokens need "
                                             f"{-(-longest // bs)} blocks of {bs}, the cache has {have}; lower "
                                             f"max_tokens to at most {room} or give the cache more memory")
    return token_ids


class Request:
    """One request: `request_id`, the `prompt` as given (a str, else None), its `prompt_token_ids`, its
    SamplingParams and `seqs`, its n sequences in sample order (seqs[0] is queued; the others fork from it,
    engine/scheduler.py)."""

    def __init__(self, request_id: str, prompt, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 block_size: int, detokenizer_factory=None, seeds: list[int] | None = None):
        self.request_id = request_id
        self.prompt = prompt if isinstance(prompt, str) else None
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # seeds: one per sample, drawn by the engine (a SamplingParams.seed wins over them; engine/sequence.py)
        seeds = seeds if seeds is not None else [None] * sampling_params.n
        self.seqs = [Sequence(self.prompt_token_ids, block_size, sampling_params, request_id, i,
                              detokenizer_factory(self.prompt_token_ids) if detokenizer_factory else None,
                              seed=seeds[i])
                     for i in range(sampling_params.n)]
        self.seqs[0].forks = self.seqs[1:]
        # Logprob dicts made for earlier snapshots (each is built once): per sample, and the prompt's.
        self._completion_dicts = [[] for _ in self.seqs]
        self._prompt_dicts = []

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def output(self, eos: frozenset = frozenset(), decode_token=None) -> RequestOutput:
        """A snapshot of the request now (nanovllm_ref.outputs). eos: the stop ids, to say why a sequence
        finished when a Parts.scheduler did not set finish_reason. decode_token: token id -> its text alone
        (Logprob.decoded_token), or None."""
        outputs = []
        for seq in self.seqs:
            if seq.is_finished and seq.finish_reason is None:
                ids = seq.completion_token_ids
                stopped = bool(ids) and not seq.ignore_eos and ids[-1] in eos
                seq.finish_reason = "stop" if stopped else "length"
            ids = seq.completion_token_ids
            logprobs = cumulative = None
            if seq.num_logprobs is not None:
                logprobs = self._logprob_dicts(seq.logprobs, self._completion_dicts[seq.index], len(ids), decode_token)
                cumulative = seq.cumulative_logprob
            outputs.append(CompletionOutput(index=seq.index, text=completion_text(seq), token_ids=ids,
                                            finish_reason=seq.finish_reason if seq.is_finished else None,
                                            stop_reason=seq.stop_reason if seq.is_finished else None,
                                            cumulative_logprob=cumulative, logprobs=logprobs))
        prompt_logprobs = None
        if self.sampling_params.prompt_logprobs is not None:
            first = self.seqs[0]
            prompt_logprobs = [None] + self._logprob_dicts(first.prompt_logprobs, self._prompt_dicts,
                                                           len(self.prompt_token_ids) - 1, decode_token)
        # prompt_token_ids: one list shared by the request's snapshots (copying it every step would cost
        # more than the rest of a snapshot for long prompts)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _logprob_dicts(raw: list, built: list, count: int, decode_token) -> list[dict]:
        """The first `count` raw rows (token ids, logprobs, rank of the first) as vLLM's dicts
        {token_id: Logprob}: the chosen token with its rank, then the top tokens with ranks 1, 2, ... (a
        chosen token that is also among the top keeps its top rank, as in vLLM). Rows already turned into
        dicts by an earlier snapshot are reused (`built` grows)."""
        for ids, lps, rank in raw[len(built):count]:
            ranks = [rank, *range(1, len(ids))]
            built.append({t: Logprob(lp, r, decode_token(t) if decode_token else None)
                          for t, lp, r in zip(ids, lps, ranks)})
        return built[:count]
