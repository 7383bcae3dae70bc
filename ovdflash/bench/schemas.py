"""JSON-schema answers for structured-output benchmarks and tests: 20 (prompt, schema) tasks.

Contract: `SCHEMA_TASKS` is a list of (user prompt, JSON schema); the schemas cover nested objects,
arrays with bounds, enums and consts, integers and numbers with bounds, required and optional
fields, booleans, nulls, unions and strings with patterns or a maxLength. Every string is bounded
(maxLength or pattern), every array has maxItems and every schema's whitespace is fixed
(`x-guidance` whitespace_flexible false), so a model that writes anything the grammar allows still
closes the answer within ~64 tokens. `schema_prompt(task)` is the prompt with its schema appended,
as a user turn would ask for it.
"""
from __future__ import annotations

import json


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def _string(max_length: int = 8) -> dict:
    return {"type": "string", "maxLength": max_length}


def _integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


_TASKS = [
    ("What is the weather in Paris today?", _object({"city": _string(), "rain": {"type": "boolean"}})),
    ("Pick a digit between 0 and 9.", _object({"n": _integer(0, 9)})),
    ("How urgent is a leaking roof?", _object({"level": {"enum": ["low", "mid", "high"]}})),
    ("Did the web request succeed? Give its HTTP status.",
     _object({"ok": {"type": "boolean"}, "code": _integer(100, 599)})),
    ("Give up to three short tags for a post about Python.",
     _object({"tags": {"type": "array", "items": _string(6), "maxItems": 3}})),
    ("Where is the origin of a 2D grid?", _object({"point": _object({"x": _integer(-5, 5), "y": _integer(-5, 5)})})),
    ("Make up a product id: two capital letters and three digits.",
     _object({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}})),
    ("How confident are you that the sun rises tomorrow, from 0 to 1?",
     _object({"score": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("Describe a person: a name, and an age if you know it.",
     _object({"name": _string(), "age": _integer(0, 120)}, required=["name"])),
    ("List one or two settings, each a key from 1 to 3 and whether it is on.",
     _object({"items": {"type": "array", "items": _object({"k": {"enum": [1, 2, 3]}, "v": {"type": "boolean"}}),
                        "minItems": 1, "maxItems": 2}})),
    ("What color is the sky? Give its hex code too.",
     _object({"color": {"enum": ["red", "green", "blue"]}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("Is the innermost switch on?", _object({"a": _object({"b": _object({"c": {"type": "boolean"}})})})),
    ("When did the project start? Give an ISO date.",
     _object({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("Give two to four numbers below 100.",
     _object({"nums": {"type": "array", "items": _integer(0, 99), "minItems": 2, "maxItems": 4}})),
    ("Report that the job is done and how many tries it took.",
     _object({"status": {"const": "done"}, "count": _integer(1, 3)})),
    ("Is the flag set? Say null if unknown.", _object({"flag": {"type": ["boolean", "null"]}})),
    ("Classify the answer as a or b, with a digit or a yes/no detail.",
     _object({"kind": {"enum": ["a", "b"]}, "detail": {"anyOf": [_integer(0, 9), {"type": "boolean"}]}})),
    ("What is the temperature in London?",
     _object({"temp": {"type": "number", "minimum": -10, "maximum": 40}, "unit": {"enum": ["C", "F"]}})),
    ("Describe a user account and its permissions.",
     _object({"user": _object({"name": _string(5), "admin": {"type": "boolean"}}),
              "roles": {"type": "array", "items": {"enum": ["r", "w", "x"]}, "maxItems": 3}})),
    ("Give a short lowercase word and its length.",
     _object({"word": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "len": _integer(1, 5)})),
]

SCHEMA_TASKS: list[tuple[str, dict]] = [
    (prompt, {**schema, "x-guidance": {"whitespace_flexible": False}}) for prompt, schema in _TASKS]


def schema_prompt(task: tuple[str, dict]) -> str:
    prompt, schema = task
    shown = {k: v for k, v in schema.items() if k != "x-guidance"}
    return f"{prompt} Answer with JSON only, following this schema: {json.dumps(shown)}"
