"""Incremental detokenization: token ids in, text out, one step at a time, never half a character.

Qwen's tokenizer is byte-level BPE: every token stands for a run of UTF-8 bytes, and a character of two to
four bytes (é, 東, 🙂) may be split across tokens. Decoding each new token on its own would print a
replacement character for each half. So the detokenizer turns each token into its bytes and feeds them to
Python's incremental UTF-8 decoder, which returns only complete characters and keeps the bytes of an
unfinished one until the token that completes it arrives.

Special tokens (<|im_end|>, <|endoftext|>) add no text, as with HF's decode(skip_special_tokens=True).

OffsetDetokenizer is the general method, for any tokenizer, and the reference the byte shortcut is tested
against: decode a window of recent tokens with the tokenizer's own decoder, release only the text the newest
tokens added, and hold while it ends in U+FFFD (vLLM's detokenize_incrementally, from HF's TGI). It costs a
decode of the window per step; the server uses IncrementalDetokenizer, which reads each token's bytes once.
"""
from __future__ import annotations

import codecs
from functools import lru_cache

from tokenizers import Tokenizer, decoders

from shared.errors import CourseError


# Task L9.1: token ids -> bytes (GPT-2's byte alphabet inverted) -> text through an incremental UTF-8 decoder
@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of byte-level BPE's alphabet: GPT-2 shows each byte as a printable character
    (printable bytes as themselves, the other 68 as code points from 256 up, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenBytes:
    """Token id -> the bytes it stands for, built once per tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise CourseError("the tokenizer is not byte-level BPE; L9's detokenizer reads byte-level tokens only")
        self.tokenizer = tokenizer
        self.added = {tok_id: tok for tok_id, tok in tokenizer.get_added_tokens_decoder().items()}
        self.to_byte = _unicode_to_byte()
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        if token_id not in self.cache:
            self.cache[token_id] = self._bytes(token_id)
        return self.cache[token_id]

    # Task L9.1: token ids -> bytes (GPT-2's byte alphabet inverted) -> text through an incremental UTF-8 decoder
    def _bytes(self, token_id: int) -> bytes:
        added = self.added.get(token_id)
        if added is not None:  # added tokens are stored as their text, not as byte-level symbols
            return b"" if added.special else added.content.encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""  # an id past the vocabulary's end (the embedding is padded): no text
        return bytes(self.to_byte[ch] for ch in piece)


class IncrementalDetokenizer:
    """One output stream: `push(ids)` returns the text those ids complete; `flush()` what is left at the end."""

    def __init__(self, token_bytes: TokenBytes):
        self.token_bytes = token_bytes
        # errors="replace": bytes that can never form a character (a model may emit any token) become U+FFFD
        # once it is certain, exactly what HF's decode would show; an unfinished character is only held.
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    # Task L9.1: token ids -> bytes (GPT-2's byte alphabet inverted) -> text through an incremental UTF-8 decoder
    def push(self, token_ids: list[int]) -> str:
        return self.utf8.decode(b"".join(self.token_bytes(t) for t in token_ids))

    # Task L9.1: token ids -> bytes (GPT-2's byte alphabet inverted) -> text through an incremental UTF-8 decoder
    def flush(self) -> str:
        """At the end of the output: an unfinished character will never be finished, so it is replaced."""
        return self.utf8.decode(b"", final=True)

    @property
    def held(self) -> bytes:
        """Bytes of a character still waiting for its last bytes."""
        return self.utf8.getstate()[0]


PREFIX_TOKENS = 5  # prompt tokens decoded before the first output token (vLLM's initial offset)


class OffsetDetokenizer:
    """Incremental detokenization by prefix and read offsets, for any tokenizer.

    `ids[prefix_offset:read_offset]` is context already released, decoded again only so that the decoder sees
    what precedes the new tokens: SentencePiece's decoder drops the leading space of whatever it decodes
    ("▁world" alone is "world"), and its byte-fallback tokens (<0xF0>) decode alone to U+FFFD. The new text
    is the window's decode minus the context's; it is held while it does not grow or ends in U+FFFD (a
    character still missing bytes), and once released both offsets move up."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)[-PREFIX_TOKENS:]  # context for the first output token, never released
        self.prefix_offset, self.read_offset = 0, len(self.ids)  # into self.ids
        self.dropped = 0  # ids dropped from the front of self.ids: offsets into the whole stream add it

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still waiting for its last bytes
        del self.ids[:self.prefix_offset]  # the window never grows past what the next decode needs
        self.dropped += self.prefix_offset
        self.prefix_offset, self.read_offset = self.read_offset - self.prefix_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """At the end of the output: text held back (an unfinished character, as U+FFFD) is released."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
