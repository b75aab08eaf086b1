"""Strict JSON request bodies for specdraft's HTTP servers: one reader and one schema check for every handler.

A server that trusts ``json.loads`` and ``int(obj["layer"])`` serves ``{"layer": 1.7}`` as layer 1, and a
body nested a few thousand levels deep kills the handler thread with ``RecursionError`` (the client gets
an empty reply). Here the body is bounded before it is read (``Content-Length`` required, at most
``max_bytes``), its nesting depth is measured before it is parsed (no recursion), the parse refuses
NaN/Infinity, duplicate keys and oversized numbers, and ``check_schema`` refuses every value of the
wrong type (a float or bool for an integer) or an unknown or missing field, naming the field. Every
refusal is a ``RequestError`` with a 4xx status and a message the handler sends back as JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from email.message import Message
from io import BufferedIOBase
from typing import Any, BinaryIO

#: Deepest nesting of arrays/objects a body may have (the schemas here need 3).
MAX_DEPTH = 16
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP code sent back with the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class OptionalField:
    """A schema entry for a field that may be absent (``check_schema``)."""

    def __init__(self, spec: Any):
        self.spec = spec


def read_json_body(
    headers: Mapping[str, str] | Message, rfile: BinaryIO | BufferedIOBase, *, max_bytes: int, max_depth: int = MAX_DEPTH
) -> Any:
    """Read and parse one JSON request body; ``RequestError`` 411/413/408/400 when it cannot be trusted."""
    length = headers.get("Content-Length")
    if length is None or not (length.isascii() and length.isdigit()):
        raise RequestError(411, f"send the JSON body with a Content-Length header of a byte count (got {length!r:.40})")
    if int(length) > max_bytes:
        raise RequestError(413, f"request body of {length} bytes exceeds this server's limit of {max_bytes}")
    try:
        raw = rfile.read(int(length))
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive in time ({length} bytes announced); resend the request") from None
    if len(raw) < int(length):
        raise RequestError(400, f"the body ended after {len(raw)} of the {length} bytes its Content-Length announced")
    depth = nesting_depth(raw, max_depth)
    if depth > max_depth:
        raise RequestError(400, f"the request body nests arrays/objects deeper than {max_depth} levels")
    try:
        return json.loads(raw, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except RequestError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, an integer of too many digits
        raise RequestError(400, f"the request body is not valid JSON ({exc!s:.200})") from None


def nesting_depth(raw: bytes, limit: int) -> int:
    """The deepest array/object nesting of JSON text ``raw`` (brackets inside strings do not count), found
    without parsing or recursing; counting stops past ``limit``."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub(b'""', raw)):
        depth += 1 if match.group() in (b"[", b"{") else -1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def check_schema(value: Any, spec: Any, where: str = "the request body") -> None:
    """Refuse (``RequestError`` 400) ``value`` unless it has the shape of ``spec``.

    ``spec`` is a type (``int`` refuses bools and floats, ``str``, ...), a tuple of allowed values, ``[item
    spec]`` for a list of such items, or ``{name: spec | OptionalField(spec)}`` for an object with exactly those
    fields. ``where`` names the value in the message (``slots[0].layer``).
    """
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise RequestError(400, f"{where} must be a JSON object, got {_describe(value)}")
        unknown = sorted(set(value) - set(spec))
        if unknown:
            raise RequestError(400, f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; the fields are {', '.join(spec)}")
        for name, field_spec in spec.items():
            inner = f"{name}" if where == "the request body" else f"{where}.{name}"
            if name in value:
                check_schema(value[name], field_spec.spec if isinstance(field_spec, OptionalField) else field_spec, inner)
            elif not isinstance(field_spec, OptionalField):
                raise RequestError(400, f"{where}: the field {name!r} is missing")
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise RequestError(400, f"{where} must be a JSON array, got {_describe(value)}")
        for i, item in enumerate(value):
            check_schema(item, spec[0], f"{where}[{i}]")
    elif isinstance(spec, tuple):
        if not isinstance(value, str) or value not in spec:
            raise RequestError(400, f"{where} must be one of {', '.join(map(repr, spec))}, got {_describe(value)}")
    elif not isinstance(value, spec) or (spec is int and isinstance(value, bool)):
        raise RequestError(400, f"{where} must be {_NAMES.get(spec, spec.__name__)}, got {_describe(value)}")


_NAMES = {int: "an integer", str: "a string", float: "a number", bool: "true or false"}


def _describe(value: Any) -> str:
    kind = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)
    return kind if isinstance(value, (list, dict)) else f"{kind} {json.dumps(value)[:60]}"


def _refuse_constant(name: str) -> Any:
    raise RequestError(400, f"the request body holds {name}, which is not JSON; send finite numbers")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RequestError(400, f"the request body repeats the field {key!r}; send each field once")
            seen.add(key)
    return obj
