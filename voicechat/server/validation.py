"""Bounded parsing and field validation of client messages, for every dialect's handler.

Each function either returns a clean value or raises `MessageRefused(code, message)`; the
message names the field and what is allowed, and echoes at most a short escaped excerpt of
the input (`security.excerpt`). Nothing else escapes: a handler that calls
`parse_json_object(...)` and the `field_*` helpers inside `try: ... except MessageRefused`
cannot be killed by any client message.
"""

from __future__ import annotations

import json
import math

from voicechat.server.security import excerpt

MAX_JSON_DEPTH = 32  # the deepest object/array nesting a message may have (ours need 3)
MAX_NUMBER_CHARS = 40  # the longest number literal (an int64 has 19 digits)


class MessageRefused(ValueError):
    """A client message the server refuses; `code` goes into the `error` event; the connection stays usable."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def check_size(text, max_bytes: int) -> None:
    # A str of n characters has between n and 4n UTF-8 bytes: only the undecided range is encoded.
    if isinstance(text, (bytes, bytearray)) or len(text) > max_bytes:
        size = len(text)
    elif 4 * len(text) <= max_bytes:
        return
    else:
        size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise MessageRefused(
            "message_too_large",
            f"message of {size} bytes exceeds the limit of {max_bytes} bytes "
            "(--max-message-bytes); send audio in smaller appends",
        )


class _Refused(ValueError):
    pass


def _parse_int(s: str) -> int:
    if len(s) > MAX_NUMBER_CHARS:
        raise _Refused(f"a number of {len(s)} digits; numbers have at most {MAX_NUMBER_CHARS} characters")
    return int(s)


def _parse_float(s: str) -> float:
    if len(s) > MAX_NUMBER_CHARS:
        raise _Refused(f"a number of {len(s)} characters; numbers have at most {MAX_NUMBER_CHARS} characters")
    v = float(s)
    if not math.isfinite(v):
        raise _Refused(f"the number {excerpt(s)} is outside the range of a 64-bit float")
    return v


def _parse_constant(s: str):
    raise _Refused(f"{s} is not JSON (non-finite numbers are not accepted)")


def _depth_ok(text: str) -> bool:
    """Nesting depth <= MAX_JSON_DEPTH, counted over brackets outside strings (one linear pass, no recursion)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return True
    depth = 0
    in_str = esc = False
    for c in text:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif c in "]}":
            depth -= 1
    return True


def parse_json_object(text) -> dict:
    """A text message -> its JSON object; every way the input can be wrong is `invalid_json` (or
    `invalid_message` for binary). Guarded: depth, number length, NaN / Infinity, lone surrogates."""
    if isinstance(text, (bytes, bytearray)):
        raise MessageRefused(
            "invalid_message",
            "binary WebSocket messages are not accepted; send JSON text messages "
            "(audio goes base64-encoded in the append message)",
        )
    if not _depth_ok(text):
        raise MessageRefused(
            "invalid_json",
            f"message nests deeper than {MAX_JSON_DEPTH} levels; expected one flat JSON object per text message",
        )
    try:
        msg = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except _Refused as e:
        raise MessageRefused("invalid_json", f"message refused: {e}") from None
    except json.JSONDecodeError as e:
        raise MessageRefused(
            "invalid_json",
            f"message is not valid JSON ({e.msg} at character {e.pos}); expected one JSON object per text message",
        ) from None
    except (ValueError, RecursionError, TypeError, OverflowError, MemoryError) as e:
        raise MessageRefused(
            "invalid_json",
            f"message is not usable JSON ({type(e).__name__}); expected one JSON object per text message",
        ) from None
    if not isinstance(msg, dict):
        raise MessageRefused("invalid_json", f"message must be a JSON object, got a JSON {_kind(msg)}")
    # Only a \uD8xx-\uDFxx escape can make a lone surrogate; walk the values only when one is present.
    if ("\\ud" in text or "\\uD" in text) and _any_surrogate(msg):
        raise MessageRefused("invalid_json", "message holds a lone UTF-16 surrogate escape; text must be valid Unicode")
    return msg


def _any_surrogate(v) -> bool:
    if isinstance(v, str):
        return _has_surrogate(v)
    if isinstance(v, dict):
        return any(_has_surrogate(k) or _any_surrogate(x) for k, x in v.items())
    if isinstance(v, list):
        return any(_any_surrogate(x) for x in v)
    return False


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def message_type(msg: dict, allowed: tuple) -> str:
    t = msg.get("type")
    if not isinstance(t, str):
        raise MessageRefused("invalid_message", "message has no string 'type'; expected one of " + ", ".join(allowed))
    if t not in allowed:
        raise MessageRefused(
            "unknown_type", f"unknown message type {excerpt(t)}; expected one of " + ", ".join(allowed)
        )
    return t


# -- fields: each names the field and what is allowed


def field_int(obj: dict, key: str, name: str, lo: int, hi: int, default, code: str):
    """An integer in [lo, hi] (not a bool, not a float)."""
    v = obj.get(key, default)
    if v is default:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MessageRefused(code, f"{name} must be an integer from {lo} to {hi}; got {_kind(v)} {excerpt(v)}")
    return v


def field_number(
    obj: dict,
    key: str,
    name: str,
    lo: float,
    hi: float,
    default,
    code: str,
    *,
    lo_open: bool = False,
    allow_null: bool = False,
):
    """A finite number in [lo, hi] ((lo, hi] with lo_open); null allowed with allow_null."""
    v = obj.get(key, default)
    if v is default or (v is None and allow_null):
        return v
    ok = (
        not isinstance(v, bool)
        and isinstance(v, (int, float))
        and math.isfinite(v)
        and (lo < v if lo_open else lo <= v)
        and v <= hi
    )
    if not ok:
        rng = f"{'above' if lo_open else 'from'} {lo:g} {'and at most' if lo_open else 'to'} {hi:g}"
        raise MessageRefused(
            code, f"{name} must be a number {rng}{' or null' if allow_null else ''}; got {_kind(v)} {excerpt(v)}"
        )
    return float(v)


def field_str(obj: dict, key: str, name: str, max_chars: int, default, code: str, *, allow_null: bool = True):
    v = obj.get(key, default)
    if v is default or (v is None and allow_null):
        return v
    if not isinstance(v, str):
        raise MessageRefused(code, f"{name} must be a string{' or null' if allow_null else ''}; got {_kind(v)}")
    if len(v) > max_chars:
        raise MessageRefused(code, f"{name} must be at most {max_chars} characters; got {len(v)}")
    if _has_surrogate(v):
        raise MessageRefused(code, f"{name} holds a lone UTF-16 surrogate escape; it must be valid Unicode")
    return v


def field_bool(obj: dict, key: str, name: str, default, code: str):
    v = obj.get(key, default)
    if not isinstance(v, bool):
        raise MessageRefused(code, f"{name} must be true or false; got {_kind(v)} {excerpt(v)}")
    return v


def field_object(obj: dict, key: str, name: str, code: str) -> dict:
    v = obj.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise MessageRefused(code, f"{name} must be an object; got {_kind(v)}")
    return v


__all__ = [
    "MessageRefused",
    "check_size",
    "parse_json_object",
    "message_type",
    "field_int",
    "field_number",
    "field_str",
    "field_bool",
    "field_object",
    "MAX_JSON_DEPTH",
    "MAX_NUMBER_CHARS",
]
