"""The service's request bodies: the DBS options as pydantic fields, derived from `config.OPTIONS`
as the CLI flags are, for /v1/generate and the OpenAI endpoints alike.

Strict: a wrong JSON type (`"beams": "7"`, `"guarantee": "yes"`) is refused and named, never
coerced; an unknown field is refused."""
from __future__ import annotations

from typing import Optional

from ..config import (
    OPTIONS,
    body_attr,
    door_name,
    door_words,
    parse_bool,
    parse_logit_bias,
)

# OPTIONS' types -> JSON's
TYPES = {int: int, float: float, str: str, parse_bool: bool, "switch": bool, parse_logit_bias: dict[str, float]}


def body_config(**extra):
    """The pydantic config of every request body."""
    from pydantic import ConfigDict

    return ConfigDict(extra="forbid", strict=True, **extra)


def option_fields(door: str, names) -> dict:
    """{attribute: (type, Field)} of the DBSConfig options `names`, as `door` names them
    (`config.door_name`), each described in `door`'s words; "lambda", a Python keyword, is the
    alias of an attribute named like the field (`body_attr`)."""
    from pydantic import Field

    def alias(name):
        key = door_name(name, door)
        return key if body_attr(name, door) != key else None

    return {body_attr(name, door): (Optional[TYPES[typ]], Field(None, description=door_words(text, door), alias=alias(name)))
            for name, _, typ, text in OPTIONS if name in names}


def given_options(body, door: str, names) -> dict:
    """The options `names` a parsed body of `door` holds (field -> value; None = not given)."""
    return {name: getattr(body, body_attr(name, door)) for name in names}


def fault(errors: list[dict]) -> tuple[str | None, str]:
    """(the field at fault, a message) from pydantic's errors of a body (locations start at "body")."""
    def field(e):
        loc = [p for p in e.get("loc", ()) if p != "body"]
        if e.get("type") == "json_invalid" or not loc:             # the body itself: not JSON, not an object
            return "body"
        return str(loc[0]) if isinstance(loc[0], str) else None

    def message(e):
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON ({(e.get('ctx') or {}).get('error', 'JSON decode error')})"
        if field(e) == "body":
            return f"the body must be a JSON object ({e.get('msg', 'invalid')})"
        if e.get("type") == "extra_forbidden":
            return "not a field of this endpoint (its fields: the service's /docs and /openapi.json)"
        return e.get("msg", "invalid")

    parts = []
    for e in errors:
        f = field(e)
        parts.append(message(e) if f in (None, "body") else f"`{f}`: {message(e)}")
    fields = [field(e) for e in errors if field(e)]
    return (fields[0] if fields else None), "; ".join(dict.fromkeys(parts)) or "invalid request body"
