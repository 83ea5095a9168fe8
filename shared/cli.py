"""The options every smoke script accepts, and their validation into one-line errors (exit status 2)."""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable

import torch

from shared.errors import CourseError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; the course contract is one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def smoke_parser(lesson: str, description: str, *, blocks: bool, default_prompts: list[str], block_size: int = 16,
                 pool_default: str = "4096 tokens' worth") -> OneLineParser:
    """The common options. A lesson whose smoke sizes its pool differently says how in `pool_default`."""
    p = OneLineParser(prog=f"{lesson.lower()}_smoke.py", description=description)
    p.add_argument("--model", help="HF-format Qwen3 or Llama checkpoint directory, or a named model: smollm2 "
                                   "(default: the embedded tiny model)")
    p.add_argument("--prompt", action="append", help=f"repeatable (default: {default_prompts!r})")
    p.add_argument("--max-new-tokens", type=int, default=20)
    if blocks:
        p.add_argument("--block-size", type=int, default=block_size, help=f"tokens per KV block (default: {block_size})")
        p.add_argument("--num-blocks", type=int, help=f"KV pool size in blocks (default: {pool_default})")
        p.add_argument("--trace", metavar="FILE", help="write the lesson's pool trace (JSON lines) here; "
                                                     "python scripts/pool_viewer.py --trace FILE draws it")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (cuda when available)")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(prompt_defaults=default_prompts)
    return p


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise CourseError(f"unknown device {name!r}: use cpu, cuda or auto")
    if name == "cuda" and not torch.cuda.is_available():
        raise CourseError("--device cuda asked for, but torch sees no CUDA GPU on this machine")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise CourseError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_model_dir(arg: str | None, build_default: Callable[[], Path]) -> Path:
    """A local directory; a named model ("smollm2", converted once into the cache); a hub id ("Qwen/Qwen3-0.6B")
    only when named and not a local path."""
    from shared.named_models import NAMED, named_model_dir
    from shared.tiny_qwen3 import cache_root

    if arg is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return build_default()
    path = Path(arg).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CourseError(f"--model {arg}: not a directory")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return path
    if arg in NAMED:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return named_model_dir(arg, cache_root())
    if HUB_ID.match(arg):
        return _download(arg)
    raise CourseError(f"model directory {arg} does not exist")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "chat_template*"]  # newer checkpoints keep the chat template in its own file
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # network, auth or a wrong id: all the user's to fix
        raise CourseError(f"model {repo_id} is not a local directory and could not be downloaded: {type(e).__name__}")

