"""Chat messages -> prompt text, by the checkpoint's own chat template (transformers' apply_chat_template).

A real Qwen3 checkpoint ships its template (with thinking and tools); the embedded model ships a plain
ChatML one (shared/tiny_qwen3.py). The rendered text holds the special tokens as text (<|im_start|>), and
the tokenizer encodes them back to their ids.
"""
from __future__ import annotations

import inspect
from pathlib import Path

from lessons.l9_server.protocol import ApiError


class ChatTemplate:
    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer  # heavy import, only for a server that serves chat

        self.hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        # The caller's chat_template_kwargs go to the template (enable_thinking=False for Qwen3); names that
        # apply_chat_template itself takes (tokenize, add_generation_prompt, ...) would change what it returns.
        self.reserved = set(inspect.signature(self.hf_tokenizer.apply_chat_template).parameters) - {"kwargs"}

    @property
    def available(self) -> bool:
        return bool(self.hf_tokenizer.chat_template)

    def render(self, messages: list[dict], kwargs: dict) -> str:
        if not self.available:
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        for name in kwargs:
            if name in self.reserved:
                raise ApiError(400, f"chat_template_kwargs.{name} is not a template variable", "chat_template_kwargs")
        try:
            return self.hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:  # the template's own checks (raise_exception), or jinja errors: the request's fault
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
