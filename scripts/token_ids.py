"""Token IDs of any text under a checkpoint's tokenizer, and the checkpoint's EOS IDs.

    python scripts/token_ids.py "Hello, world!" "The capital of France is"
    python scripts/token_ids.py --model ~/qwen3-0.6b "Hello"

The IDs a smoke feeds for a prompt, before you quote them or type them into a test.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    p = OneLineParser(prog="token_ids.py", description=__doc__.splitlines()[0])
    p.add_argument("texts", nargs="+", metavar="TEXT")
    p.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: the embedded tiny model)")
    args = p.parse_args()
    try:
        model_dir = resolve_model_dir(args.model, default_model_dir)
        tokenizer, eos = load_tokenizer(model_dir), Qwen3Config.from_dir(model_dir).eos_token_ids
    except CourseError as e:
        p.error(str(e))
    for text in args.texts:
        ids = tokenizer.encode(text).ids
        print(f"{text!r} -> {ids} ({len(ids)} token{'s' if len(ids) != 1 else ''})")
    print(f"EOS ids: {list(eos)} ({', '.join(repr(tokenizer.decode([i], skip_special_tokens=False)) for i in eos)})")


if __name__ == "__main__":
    main()
