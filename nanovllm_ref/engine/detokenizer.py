"""Incremental detokenization: the text of a growing completion, a few tokens at a time (chapter 07; the
serving chapter streams it).

Decoding the completion's ids alone loses what the prompt's end says about them:
- a SentencePiece (Metaspace) decoder drops the leading space of the first token it decodes, so "Hello
  world" + ["▁s", "▁quick"] would come out as "s quick" instead of " s quick";
- a byte-level BPE token can hold the last bytes of a character whose first bytes are in the prompt's last
  token; decoded alone they are U+FFFD.

So every decode here starts a few tokens *before* the text it is after (vLLM's `detokenize_incrementally`,
TGI's `decode_token`). Two offsets into the ids, prefix <= read: the text up to `read` is already out, and
ids[prefix:read] is context. When tokens arrive, decode ids[prefix:read] and ids[prefix:]; the new text is
the second minus the first. Both decodes start at the same token, so whatever a decoder does at the start
of a decode (Metaspace's stripped space, U+FFFD for a character cut at the window's start) happens in both
and cancels. If the longer decode ends in U+FFFD, the last token stopped inside a character: nothing is
emitted until the character is complete (`flush` emits it anyway at the end). Then the window moves on:
prefix = the old read, read = the end.

Byte-fallback tokens (`<0xE6>`, SentencePiece's way to spell a character it has no piece for) need one more
rule: the ByteFallback decoder decodes a whole run of them at once, and if the run is not valid UTF-8 every
byte of it becomes U+FFFD, even a valid "\n" at its start. So a run's text is known only when the run ends:
nothing is emitted while the last token that shows is a byte token, and a window never starts right after
a byte token. (Tokens the decoder never sees do not end a run: special tokens that are skipped, and ids
past the tokenizer's vocabulary, which a model with a padded embedding table can sample.)

The contract (vLLM, TGI): decode(prompt) + text == decode(prompt + completion) wherever decode(prompt) is
the start of decode(prompt + completion), with one decode per emitted piece of a few tokens, so the cost
per token does not grow with the length. A character split between the prompt and the completion belongs
to the completion (decode(prompt) ends in U+FFFD there). The text only ever grows by appending, so a
server can stream the pieces, and streaming token by token gives the same text as decoding all at once.
Decoding is the tokenizer's `decode` without `clean_up_tokenization_spaces`, as in vLLM (for a fast
tokenizer, its `tokenizers` backend's decode, which is what HF's decode calls).
"""
import weakref
from os.path import commonprefix

REPLACEMENT = "\ufffd"          # what a decoder writes for bytes that are not (yet) a whole character
CONTEXT_TOKENS = 5              # prompt tokens of context, as vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
_TOKEN_SETS = weakref.WeakKeyDictionary()


def token_sets(tokenizer) -> tuple[frozenset, frozenset]:
    """(ids of the byte-fallback tokens "<0x00>".."<0xFF>", ids of the special tokens) of `tokenizer`,
    looked up once per tokenizer. A byte-level BPE has no byte-fallback tokens."""
    sets = _TOKEN_SETS.get(tokenizer)
    if sets is None:
        unk = tokenizer.unk_token_id
        found = (tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256))
        sets = _TOKEN_SETS[tokenizer] = (frozenset(i for i in found if i is not None and i != unk),
                                         frozenset(tokenizer.all_special_ids))
    return sets


class IncrementalDetokenizer:
    """Text of the completion of one sequence.

    tokenizer: an HF tokenizer (its `decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)`).
    prompt_token_ids: the prompt (list of int); its last CONTEXT_TOKENS tokens are the first context (more
        if those decode to nothing, e.g. special tokens that are skipped: the window must start at a token
        that shows, or a Metaspace decoder would strip the space of the completion's first token).
    skip_special_tokens: leave special tokens out of the text.
    `text` is the completion's text so far; `num_tokens` counts the completion tokens taken in.
    """

    def __init__(self, tokenizer, prompt_token_ids, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = getattr(tokenizer, "backend_tokenizer", None)     # a `tokenizers.Tokenizer`
        self._byte_ids, special = token_sets(tokenizer)
        self._skipped = special if skip_special_tokens else frozenset()
        self._vocab_len = len(tokenizer)
        ids = [int(t) for t in prompt_token_ids]
        read = len(ids)
        prefix = max(read - CONTEXT_TOKENS, 0)
        while prefix > 0:
            if ids[prefix - 1] in self._byte_ids or self._unseen(ids[prefix - 1]):
                prefix -= 1                    # never start right after a byte token (or inside a run)
            elif not self._decode(ids[prefix:read]):
                prefix -= 1                    # a window that shows nothing: no token to anchor it
            else:
                break
        self._ids = ids[prefix:]           # earlier ids never take part in a decode again
        self._prefix, self._read = 0, read - prefix
        self.text = ""
        self.num_tokens = 0
        self.flushed = False

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:          # what a fast tokenizer's decode runs, without its checks (~5x)
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self, token_ids) -> str:
        """Take in new completion token ids; returns the text they add (may be "" while a character or a
        word piece is incomplete). Raises RuntimeError after `flush`."""
        if self.flushed:
            raise RuntimeError("this detokenizer was flushed: the completion is over")
        token_ids = list(token_ids)
        self._ids.extend(token_ids)
        self.num_tokens += len(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The completion is over: emit what is held back, even a character cut short (as U+FFFD, what
        decoding all the ids gives). Returns the text it adds; later calls return ""."""
        if self.flushed:
            return ""
        new = self._emit(final=True)
        self.flushed = True
        return new

    def truncate(self, length: int) -> None:
        """Cut the text to its first `length` characters (a stop string was found) and end the completion."""
        self.text = self.text[:length]
        self.flushed = True

    def _unseen(self, token_id: int) -> bool:
        """The decoder never sees this token: a skipped special token, or an id the tokenizer does not know."""
        return token_id in self._skipped or token_id >= self._vocab_len

    def _in_byte_run(self) -> bool:
        """The last token the decoder sees is a byte-fallback token (its run may go on)."""
        if not self._byte_ids:
            return False
        for t in reversed(self._ids):
            if not self._unseen(t):
                return t in self._byte_ids
        return False

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        # `context` is the start of `full`, except when the prompt's last token ends inside a character:
        # then `context` ends in U+FFFD where `full` has the whole character, which belongs to the new text.
        start = len(context) if full.startswith(context) else len(commonprefix([context, full]))
        new = full[start:]
        if not new or not final and (full.endswith(REPLACEMENT) or self._in_byte_run()):
            return ""
        # Move the window on, unless the new tokens decode to nothing on their own (a lone Metaspace space,
        # which a decode that starts with it strips): the context must start at a token that shows.
        if not new.isspace() or self._decode(self._ids[self._read:]):
            del self._ids[:self._read]
            self._prefix = 0
        self._read = len(self._ids)
        self.text += new
        return new
