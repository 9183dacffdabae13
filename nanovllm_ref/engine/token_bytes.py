"""Each token's own bytes and text, for logprobs (`Logprob.decoded_token`; the server's `bytes` and text_offset).

A token can hold part of a character: byte-level BPE (GPT-2, Qwen, SmolLM2) spells an emoji as two or more
tokens of raw UTF-8 bytes, and SentencePiece's byte fallback spells it as `<0xF0><0x9F>...`. Decoding such
a token alone gives U+FFFD ("�"), so every piece of an emoji would show as the same "�": its bytes
[239, 191, 189], not its own, and several pieces among the top logprobs would share one name. (vLLM had the
same fault: vllm-project/vllm#27300.)

So a token's bytes are read from the vocabulary, as the tokenizer's decoder would produce them in the middle
of a text:
- byte-level (a `ByteLevel` decoder): each character of the piece stands for one byte (GPT-2's table of 256
  printable characters, `byte_decoder`);
- SentencePiece (`ByteFallback`, `Replace` or `Metaspace` decoders): `<0xAB>` is the byte 0xAB, and "▁" is a
  space (the decoders' `Strip` of the text's first space does not apply inside a text);
- added and special tokens: their content's UTF-8;
- any other tokenizer (or one without a `backend_tokenizer`): the token decoded alone, as before.

Concatenated, the bytes of a completion's tokens are its text's UTF-8 (OpenAI's meaning of `bytes`: "useful
when characters are represented by multiple tokens"). A token's text is its bytes decoded when they are
valid UTF-8 alone; otherwise the bytes written out as `bytes:\\xf0\\x9f` (the form OpenAI's API uses for
such tokens), which names each piece apart.
"""
import functools
import json
import re

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each of the 256 bytes.
    Bytes that are printable Latin-1 characters stand for themselves; the other 68 (controls, space, 0x7F-0xA0,
    0xAD) take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tokenizer) -> set[str]:
    """The type names in the tokenizer's decoder (a Sequence's parts too); empty without a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return set()
    found, todo = set(), [decoder]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            found.add(d.get("type"))
            todo.extend(d.get("decoders") or [])
    return found


class TokenBytes:
    """tokenizer -> each token id's bytes and text (module docstring). Cached per id; safe to share across
    threads (the caches are functools.lru_cache)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self.kind = ("byte_level" if "ByteLevel" in types else
                     "sentencepiece" if types & {"ByteFallback", "Replace", "Metaspace"} else None)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): t.content for i, t in added.items()}
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)
        self.text = functools.lru_cache(maxsize=65536)(self._text)

    def _bytes(self, token_id: int) -> bytes:
        """The token's bytes as its decoder writes them inside a text (b"" for an id the tokenizer lacks)."""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.kind else None
        if piece is None:                             # unknown decoder kind, or an id past the vocabulary
            return self.tokenizer.decode([token_id]).encode("utf-8")
        if self.kind == "byte_level":
            table = byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")
        match = _BYTE_TOKEN.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode("utf-8")

    def _text(self, token_id: int) -> str:
        """The token's text: its bytes as UTF-8, or `bytes:\\xf0\\x9f` when they are not valid UTF-8 alone."""
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@functools.lru_cache(maxsize=8)
def token_bytes_for(tokenizer) -> TokenBytes:
    """The TokenBytes of `tokenizer`, made once (the server asks for it with each response)."""
    return TokenBytes(tokenizer)
