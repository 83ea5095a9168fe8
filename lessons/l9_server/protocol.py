"""The OpenAI request bodies, checked field by field into what the engine takes.

Every bad value becomes an ApiError naming its field, which the app turns into OpenAI's error object. Each
field a client may send (OpenAI's API, and the vLLM extensions real clients send) is in one group below:
IMPLEMENTED does what the API says; IGNORED changes nothing the server returns or promises (who asks,
caching hints), so any value is accepted; NEUTRAL asks for something the server cannot do (log-probabilities,
tools, a penalty, a stored completion, a service tier), so it is refused by name ("unsupported field") unless
given its do-nothing value (logprobs: false, a penalty of 0, store: false). Only a field in no group is
"unknown": neither OpenAI's API nor vLLM defines it, so it is most likely a typo.
"""
from __future__ import annotations

from dataclasses import dataclass

from lessons.l4_continuous.sampling import SEED_LIMIT, SamplingParams
from shared.errors import CourseError

MAX_STOP_STRINGS = 4  # as OpenAI's API

# IMPLEMENTED. Extensions beyond OpenAI's API are vLLM's names for the same things.
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "top_k", "stop_token_ids", "ignore_eos", "return_token_ids"}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}  # continuous_usage_stats: vLLM's, usage on every chunk
# IGNORED, whatever their value: who asks (user, safety_identifier), how fast an answer may come
# (prompt_cache_*, prediction: the output is the same). spaces_between_special_tokens (vLLM) only matters for
# special tokens in the text, and this server never shows them.
IGNORED = {"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
           "prediction", "spaces_between_special_tokens"}
# include_obfuscation pads each chunk with a random string hiding its size on the wire; OpenAI sends it
# unless told not to, and no client reads it, so either value is accepted and no padding is sent.
IGNORED_STREAM_OPTIONS = {"include_obfuscation"}
# NEUTRAL: asks for something this server cannot do, so refused unless given the value that asks for nothing.
# OpenAI's first, then vLLM's extensions. reasoning_effort: a Qwen3 template thinks or not by
# chat_template_kwargs. store, metadata and service_tier change no token, but promise what this server does
# not keep: a completion stored for later retrieval (metadata tags a stored one), a tier billed and reported.
NEUTRAL = {"logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0),
           "frequency_penalty": (None, 0), "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""),
           "best_of": (None, 1), "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
           "response_format": (None, {"type": "text"}), "functions": (None, []), "function_call": (None, "none"),
           "reasoning_effort": (None,), "verbosity": (None,), "modalities": (None, ["text"]), "audio": (None,),
           "web_search_options": (None,), "moderation": (None,),
           "min_tokens": (None, 0), "repetition_penalty": (None, 1), "min_p": (None, 0), "length_penalty": (None, 1),
           "use_beam_search": (None, False), "skip_special_tokens": (None, True),
           "include_stop_str_in_output": (None, False), "add_generation_prompt": (None, True),
           "continue_final_message": (None, False), "truncate_prompt_tokens": (None,),
           "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default")}
# What the refusal says the server does not do, where "implement it" says too little.
NEUTRAL_REASONS = {
    "reasoning_effort": "implement it: pass chat_template_kwargs {\"enable_thinking\": false} to turn thinking off",
    "store": "store completions (send false, or leave it out)",
    "metadata": "store completions to attach metadata to (send {}, or leave it out)",
    "service_tier": "have service tiers (send \"auto\" or \"default\", or leave it out)"}
ROLES = {"system", "developer", "user", "assistant"}


class ApiError(Exception):
    """A request the server refuses: HTTP status, OpenAI's error type, and the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request, endpoint-independent. `prompt` is text (chat: already templated) or token ids."""

    prompt: str | list[int]
    max_tokens: int
    sampling: SamplingParams
    n: int
    stop_strings: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far on every chunk


def parse_completion(body: dict, default_max_tokens: int, context: int | None = None) -> GenerationRequest:
    check_fields(body, COMPLETION_FIELDS)
    return parse_common(body, completion_prompt(body.get("prompt"), context), default_max_tokens)


def parse_chat(body: dict, default_max_tokens: int) -> tuple[list[dict], dict, GenerationRequest]:
    """(messages, chat_template_kwargs, request whose prompt is still empty: the app renders the template)."""
    check_fields(body, CHAT_FIELDS)
    messages = chat_messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    if "max_completion_tokens" in body and "max_tokens" in body:
        raise ApiError(400, "give max_completion_tokens or max_tokens, not both", "max_completion_tokens")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return messages, kwargs, parse_common(body, "", default_max_tokens, key)


# Task L9.3: check each field a client sends: a bad value is an ApiError(400) naming it (param)
def check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed or name in IGNORED:
            continue
        if name in NEUTRAL:
            if not neutral(value, NEUTRAL[name]):
                raise ApiError(400, f"unsupported field {name!r}: this server does not "
                                    f"{NEUTRAL_REASONS.get(name, 'implement it')}", name)
        elif name in COMPLETION_FIELDS | CHAT_FIELDS:  # the other endpoint's field
            raise ApiError(400, f"{name} is not a field of this endpoint", name)
        else:
            raise ApiError(400, f"unknown field {name!r}: neither OpenAI's API nor vLLM defines it", name)


# Task L9.3: check each field a client sends: a bad value is an ApiError(400) naming it (param)
def neutral(value: object, do_nothing: tuple) -> bool:
    # 0.0 is a penalty of 0, but true is not a best_of of 1: bools only match bools
    return value is None or any(value == v and (type(value) is bool) == (type(v) is bool) for v in do_nothing)


def parse_common(body: dict, prompt: str | list[int], default_max_tokens: int,
                 max_key: str = "max_tokens") -> GenerationRequest:
    if not isinstance(body.get("model"), str):
        raise ApiError(400, "model is required and must be a string", "model")
    max_tokens = integer(body, max_key, default_max_tokens, low=1)
    temperature = number(body, "temperature", 1.0, low=0.0, high=2.0)
    top_p = number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0:
        raise ApiError(400, "top_p must be in (0, 1], got 0", "top_p")
    top_k = integer(body, "top_k", 0, low=-1)
    seed = integer(body, "seed", None, low=0, high=SEED_LIMIT - 1)
    n = integer(body, "n", 1, low=1, high=64)
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        for name in options:
            if name not in STREAM_OPTIONS | IGNORED_STREAM_OPTIONS:
                raise ApiError(400, f"unknown field stream_options.{name}", f"stream_options.{name}")
    options = options or {}
    include_usage = boolean(options, "include_usage", name="stream_options.include_usage")
    continuous_usage = boolean(options, "continuous_usage_stats", name="stream_options.continuous_usage_stats")
    boolean(options, "include_obfuscation", name="stream_options.include_obfuscation")  # checked, then ignored
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ApiError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    try:
        sampling = SamplingParams(temperature, max(top_k, 0), top_p, seed, frozenset(stop_ids))
    except CourseError as e:  # unreachable after the checks above, kept so a new rule there names itself
        raise ApiError(400, str(e)) from None
    return GenerationRequest(prompt, max_tokens, sampling, n, stop_strings(body.get("stop")),
                             boolean(body, "ignore_eos"), stream, include_usage, boolean(body, "return_token_ids"),
                             continuous_usage)


def completion_prompt(prompt: object, context: int | None = None) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if context is not None and isinstance(prompt, list) and len(prompt) > context:  # before looking at 200,000 ids
        raise ApiError(400, f"prompt holds {len(prompt)} token ids, more than the model's context of {context}",
                       "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "batches of prompts are not supported: send one request per prompt", "prompt")
    raise ApiError(400, "prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def chat_messages(messages: object) -> list[dict]:
    """Messages as the template expects them: role and content, content as one string."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where} needs a role, one of {', '.join(sorted(ROLES))}", f"{where}.role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"{where}.{sorted(extra)[0]} is not supported by this server", f"{where}.{sorted(extra)[0]}")
        # name tells the model who speaks, but Qwen3's templates never show it to the model: the output would
        # be as if it were absent, so it is refused rather than dropped. An empty name asks for nothing.
        if m.get("name") not in (None, ""):
            raise ApiError(400, f"{where}.name is not supported by this server (the chat template ignores it): "
                                "say who speaks in the content", f"{where}.name")
        out.append({"role": m["role"], "content": message_text(m.get("content"), f"{where}.content")})
    return out


def message_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}[{j}]: only text parts are supported, got {kind!r}", f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", where)


def check_strings(body: object) -> None:
    """Refuse a lone UTF-16 surrogate ("\\ud800", legal JSON) in any key or string of the parsed body: no
    UTF-8 text holds one, so the tokenizer, and the error reply itself, would fail on it. A loop with a
    stack, not recursion: json.loads accepts nesting close to the interpreter's recursion limit."""
    stack: list[tuple[object, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                if not is_utf8(key):
                    raise ApiError(400, f"the field name {printable(key)} holds a lone UTF-16 surrogate",
                                   printable(where))
                stack.append((item, where))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value) if isinstance(item, (str, list, dict)))
        elif isinstance(value, str) and not is_utf8(value):
            raise ApiError(400, f"{path} holds a lone UTF-16 surrogate, which is not text", path)


def is_utf8(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


def printable(text: str) -> str:
    """The text with any lone surrogate written as its escape, so that the error reply can be encoded."""
    return text.encode("utf-8", "backslashreplace").decode()


# Task L9.3: check each field a client sends: a bad value is an ApiError(400) naming it (param)
def stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(stops)


# Task L9.3: check each field a client sends: a bad value is an ApiError(400) naming it (param)
def integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"{name} must be an integer {bound}, got {value!r}", name)
    return value


# Task L9.3: check each field a client sends: a bad value is an ApiError(400) naming it (param)
def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    # The chained comparison refuses NaN and infinities too; math.isfinite would overflow on a huge JSON integer.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", name)
    return float(value)


# Task L9.3: check each field a client sends: a bad value is an ApiError(400) naming it (param)
def boolean(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name or key} must be true or false, got {value!r}", name or key)
    return value
