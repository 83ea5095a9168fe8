"""L9's worked examples, printed from the code that runs in the server (docs/l9_server.md shows this output).

    python scripts/l9_walkthrough.py [--text TEXT] [--stop STOP]

1. Incremental detokenization: TEXT is encoded, then its tokens are fed back one at a time, as a server
   receives them from the engine. Per token: its id, its bytes, the text released, the bytes held back.
2. Stop strings across tokens: the same pieces go through the stop-string matcher with STOP; per piece,
   what is released and what is held, until the stop string is found.
3. The general method, for any tokenizer (lessons/l9_server/detokenizer.py's OffsetDetokenizer): the same
   tokens; per token, the window decoded and what it released.
4. Why the window: a SentencePiece-style tokenizer (Llama 2's decoder pipeline, a toy vocabulary), where a
   token decoded alone loses its leading space, beside the offset method and HF's DecodeStream.
No model runs: the tokens come from the tokenizer, so the example is exact and instant.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer, decoders, models, normalizers  # noqa: E402
from tokenizers.decoders import DecodeStream  # noqa: E402

from lessons.l9_server.detokenizer import IncrementalDetokenizer, OffsetDetokenizer, TokenBytes  # noqa: E402
from lessons.l9_server.stop_strings import StopStringMatcher  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

TEXT = "Lift-off 🚀 at 東京. END"
STOP = "at 東"
SP_TEXT, SP_PIECES = "Hello world 🚀", ["▁Hello", "▁world", "▁"]


def sentencepiece_style(pieces: list[str]) -> Tokenizer:
    """A toy laid out as Llama 2's tokenizer.json: "▁" for a space (one prepended), unigram pieces,
    <0xNN> byte-fallback tokens for the rest, and a decoder that turns "▁" into spaces, fuses byte tokens
    into characters and strips one leading space (tests/test_l9_units.py tests with this same toy)."""
    vocab = [("<unk>", 0.0)] + [(p, -1.0) for p in pieces] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def main() -> None:
    p = OneLineParser(prog="l9_walkthrough.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default=TEXT, help=f"the text to detokenize back (default: {TEXT!r})")
    p.add_argument("--stop", default=STOP, help=f"the stop string (default: {STOP!r})")
    p.add_argument("--model", help="whose tokenizer: a checkpoint directory or a named model such as smollm2 "
                   "(default: the embedded model's)")
    args = p.parse_args()
    if not args.text or not args.stop:
        p.error("--text and --stop must not be empty")
    try:
        tokenizer = load_tokenizer(resolve_model_dir(args.model, default_model_dir))
    except CourseError as e:
        p.error(str(e))
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(args.text).ids

    print(f"1. detokenizing {args.text!r}: {len(ids)} tokens, fed one at a time")
    print(f"{'token':>7}  {'bytes':<24} {'released':<12} held back")
    detokenizer, pieces = IncrementalDetokenizer(token_bytes), []
    for token in ids:
        piece = detokenizer.push([token])
        pieces.append(piece)
        print(f"{token:>7}  {str(token_bytes(token)):<24} {piece!r:<12} {detokenizer.held}")
    print(f"joined: {''.join(pieces)!r} (equal to the whole decode: {''.join(pieces) == tokenizer.decode(ids)})")

    print(f"\n2. the same pieces through the stop string {args.stop!r}")
    print(f"{'piece':<12} {'released':<12} held")
    matcher, released = StopStringMatcher((args.stop,)), []
    for piece in pieces:
        out = matcher.push(piece)
        released.append(out)
        print(f"{piece!r:<12} {out!r:<12} {matcher.held!r}{'  <- stop string found' if matcher.stopped else ''}")
        if matcher.stopped:
            break
    else:
        released.append(matcher.flush())
        print(f"end of output: the held text {released[-1]!r} is released (no stop string)")
    print(f"the client sees: {''.join(released)!r}")

    print("\n3. the offset method on the same tokens: decode ids[prefix:], release what ids[read:] added")
    print(f"{'token':>7}  {'prefix:read':<12} {'window decoded':<18} released")
    offsets, pieces = OffsetDetokenizer(tokenizer), []
    for token in ids:
        where = f"{offsets.dropped + offsets.prefix_offset}:{offsets.dropped + offsets.read_offset}"
        window = tokenizer.decode(offsets.ids[offsets.prefix_offset:] + [token], skip_special_tokens=True)
        pieces.append(offsets.push([token]))
        print(f"{token:>7}  {where:<12} {window!r:<18} {pieces[-1]!r}")
    print(f"joined: {''.join(pieces) + offsets.flush()!r}")

    sp = sentencepiece_style(SP_PIECES)
    encoding = sp.encode(SP_TEXT)
    print(f"\n4. a SentencePiece-style tokenizer, {SP_TEXT!r}: {len(encoding.ids)} tokens")
    print(f"{'token':<10} {'decoded alone':<14} {'offset method':<14} DecodeStream")
    offsets, stream, alone, released = OffsetDetokenizer(sp), DecodeStream(skip_special_tokens=True), [], []
    for piece, token in zip(encoding.tokens, encoding.ids):
        alone.append(sp.decode([token]))
        released.append(offsets.push([token]))
        print(f"{piece!r:<10} {alone[-1]!r:<14} {released[-1]!r:<14} {stream.step(sp, token)!r}")
    print(f"joined: alone {''.join(alone)!r}, offset method {''.join(released) + offsets.flush()!r}")


if __name__ == "__main__":
    main()
