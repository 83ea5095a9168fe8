"""The response objects of OpenAI's API, whole and as stream chunks, and the server-sent-event framing.

Completions answer `text_completion` objects; chat answers `chat.completion`, or `chat.completion.chunk`
when streaming. A stream is a series of `data: {json}` events, each ended by a blank line, closed by
`data: [DONE]`. With stream_options.include_usage every chunk carries "usage": null except one last chunk,
with no choices, that carries the usage. With vLLM's stream_options.continuous_usage_stats every chunk
carries the usage so far instead: the prompt's tokens and those generated up to that chunk.
"""
from __future__ import annotations

import json
import time
import uuid


# Task L9.4: OpenAI's response, its stream chunks and the SSE framing (data: {json}, blank line)
def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseShape:
    """Builds one request's objects: the same id, creation time and model name on every one of them."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool, prompt_tokens: int = 0):
        self.chat, self.model, self.return_token_ids = chat, model, return_token_ids
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # Task L9.4: OpenAI's response, its stream chunks and the SSE framing (data: {json}, blank line)
    def whole(self, texts: list[str], tokens: list[list[int]], finishes: list[str], prompt_ids: list[int],
              completion_tokens: int) -> dict:
        choices = []
        for i, (text, ids, finish) in enumerate(zip(texts, tokens, finishes)):
            choice: dict = {"index": i, "logprobs": None, "finish_reason": finish}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if self.return_token_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        out = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        out["usage"] = usage(len(prompt_ids), completion_tokens)
        if self.return_token_ids:
            out["prompt_token_ids"] = prompt_ids
        return out

    # Task L9.4: OpenAI's response, its stream chunks and the SSE framing (data: {json}, blank line)
    def chunk(self, index: int, text: str | None, token_ids: list[int], finish: str | None, include_usage: bool,
              first: bool = False, generated: int | None = None) -> dict:
        """One choice's piece. Chat: the first chunk of a choice gives the role, the others only content.
        `generated`: the tokens generated so far, for a usage object on this chunk (continuous_usage_stats)."""
        choice: dict = {"index": index, "logprobs": None, "finish_reason": finish}
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if generated is not None:
            out["usage"] = usage(self.prompt_tokens, generated)
        elif include_usage:
            out["usage"] = None
        return out

    # Task L9.4: OpenAI's response, its stream chunks and the SSE framing (data: {json}, blank line)
    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out
