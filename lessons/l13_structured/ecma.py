"""Regexes as JSON Schema means them: ECMA-262 patterns, rewritten for llguidance's (Rust) regex dialect.

A schema's `pattern` is an ECMA-262 regex (JSON Schema says so), and clients write the `regex` field the same
way. The two dialects read the same text differently: in Rust's regex crate `\\d` is any Unicode digit (`௧`,
`８`, `੭`), `\\w` any Unicode letter, `\\s` includes U+0085 but not U+FEFF, and `.` matches `\\r`. ECMA-262's
`\\d` is `[0-9]`, `\\w` is `[0-9A-Za-z_]`, `\\s` is its own list of spaces and line terminators, and `.` matches
anything but a line terminator. A client asking for an IPv4 address must get digits its parser reads, so each of
those is spelled out as an explicit class before llguidance sees the pattern. Everything else is passed as it is
(what llguidance cannot take, lookarounds and backreferences, it refuses by name).
"""
from __future__ import annotations

# ECMA-262 WhiteSpace and LineTerminator: the characters its \s matches (Rust-regex escapes)
ECMA_SPACE = r"\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
ECMA_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": ECMA_SPACE}
ECMA_DOT = r"[^\n\r\u2028\u2029]"  # `.` without the s flag: anything but a line terminator

# the keywords whose values are subschemas: one, a list of them, or a name -> schema mapping
ONE_SCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
              "else", "unevaluatedItems", "unevaluatedProperties")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")


# Task L13.3: ECMA-262 regexes for Rust's regex crate: \d \w \s, their complements and . as explicit classes
def ecma_regex(pattern: str) -> str:
    """The same language as the ECMA-262 `pattern`, written so that the Rust regex crate reads it that way."""
    out: list[str] = []
    in_class, i = False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            body = ECMA_CLASSES.get(escaped.lower())
            if body is None:  # \., \/, \uXXXX, \x41, \n, ...: the same in both dialects
                out.append(c + escaped)
            elif escaped.isupper():  # \D, \W, \S: the complement (a nested class inside a class)
                out.append(f"[^{body}]")
            else:
                out.append(body if in_class else f"[{body}]")
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == ".":
            c = ECMA_DOT
        out.append(c)
        i += 1
    return "".join(out)


# Task L13.3: ECMA-262 regexes for Rust's regex crate: \d \w \s, their complements and . as explicit classes
def ecma_schema(schema: object) -> object:
    """A copy of a JSON schema whose `pattern`s and `patternProperties` keys are rewritten by `ecma_regex`. Only
    subschemas are walked: a `pattern` inside an `enum` value or a `default` is data, not a regex."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ecma_regex(out["pattern"])
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {ecma_regex(k): ecma_schema(v) for k, v in out["patternProperties"].items()}
    for name in SCHEMA_MAPS:
        if isinstance(out.get(name), dict):
            out[name] = {k: ecma_schema(v) for k, v in out[name].items()}
    for name in ONE_SCHEMA:
        if isinstance(out.get(name), dict):
            out[name] = ecma_schema(out[name])
    for name in SCHEMA_LISTS:
        if isinstance(out.get(name), list):
            out[name] = [ecma_schema(s) for s in out[name]]
    return out

