"""The request fields that ask for structured output, checked into a GrammarSpec (or None: free text).

OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}. vLLM's `structured_outputs` (since v0.12) with
exactly one of `json` (a schema, or its JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark
or GBNF text), `json_object` (true). vLLM's tuning options under `structured_outputs` (backend, whitespace,
structural tags) are refused by name: this server has one backend and one JSON layout. Only shapes are
checked here, cheaply, on the event loop; whether a schema or a regex compiles is llguidance's to say, in
a worker thread (server.py).
"""
from __future__ import annotations

import json

from lessons.l9_server.protocol import ApiError
from lessons.l13_structured.grammar import GrammarSpec

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = {"name", "schema", "strict", "description"}
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
# vLLM's other structured_outputs fields: each tunes a backend this server does not have, or asks for a
# feature it does not implement
STRUCTURED_REFUSED = {"backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "structural_tag"}
MAX_CHOICES = 1024


def take_spec(body: dict) -> tuple[dict, GrammarSpec | None]:
    """The body without its structured-output fields (L9's parser sees the rest), and what they ask for."""
    if "response_format" not in body and "structured_outputs" not in body:
        return body, None
    rest = {k: v for k, v in body.items() if k not in ("response_format", "structured_outputs")}
    formatted = response_format(body.get("response_format"))
    structured = structured_outputs(body.get("structured_outputs"))
    if formatted is not None and structured is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    return rest, formatted or structured


def response_format(value: object) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "response_format must be an object", "response_format")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ApiError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                       "response_format.type")
    extra = set(value) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in value):
        name = sorted(extra)[0] if extra else "json_schema"
        raise ApiError(400, f"response_format.{name} is not a field of type {kind!r}", f"response_format.{name}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", origin="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object with name and schema",
                       "response_format.json_schema")
    for name in spec:
        if name not in JSON_SCHEMA_FIELDS:
            raise ApiError(400, f"unknown field response_format.json_schema.{name}",
                           f"response_format.json_schema.{name}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ApiError(400, "response_format.json_schema.name is required and must be a string",
                       "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):  # 1 == True: type, not value
        raise ApiError(400, "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    return GrammarSpec("json_schema", schema_object(spec.get("schema"), "response_format.json_schema.schema"),
                       "response_format.json_schema.schema")


def structured_outputs(value: object) -> GrammarSpec | None:
    if value is None:
        return None
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise ApiError(400, f"{where} must be an object", where)
    for name in value:
        if name in STRUCTURED_REFUSED:
            raise ApiError(400, f"unsupported field {where}.{name}: this server has one backend (llguidance) and "
                                f"writes compact JSON", f"{where}.{name}")
        if name not in STRUCTURED_KINDS:
            raise ApiError(400, f"unknown field {where}.{name}", f"{where}.{name}")
    # json_object: false asks for nothing; any other value, 0 included, is given (and checked below)
    given = [name for name in STRUCTURED_KINDS
             if value.get(name) is not None and not (name == "json_object" and value[name] is False)]
    if len(given) != 1:
        raise ApiError(400, f"{where} needs exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                            f"{', '.join(given) or 'none'}", where)
    name = given[0]
    source, field = value[name], f"{where}.{name}"
    if name == "json":
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except ValueError as e:
                raise ApiError(400, f"{field} is not valid JSON: {e}", field) from None
            except RecursionError:  # json.loads recurses once per level: the body's own guard (L9's app.py) again
                raise ApiError(400, f"{field} is not valid JSON: nested too deeply", field) from None
        return GrammarSpec("json_schema", schema_object(source, field), field)
    if name == "json_object":
        if source is not True:
            raise ApiError(400, f"{field} must be true", field)
        return GrammarSpec("json_object", origin=field)
    if name == "choice":
        if (not isinstance(source, list) or not 0 < len(source) <= MAX_CHOICES
                or not all(isinstance(c, str) and c for c in source)):
            raise ApiError(400, f"{field} must be a list of 1 to {MAX_CHOICES} non-empty strings", field)
        return GrammarSpec("choice", list(source), field)
    if not isinstance(source, str) or not source:
        raise ApiError(400, f"{field} must be a non-empty string", field)
    return GrammarSpec(STRUCTURED_KINDS[name], source, field)


def schema_object(schema: object, field: str) -> dict:
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field} must be a JSON schema object", field)
    return schema
