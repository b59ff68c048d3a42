"""A machine's load from its session slots, for a dispatcher (docs/deploy.md).

`voicechat serve --max-sessions N` serves N conversations at once; `GET /healthz` says how many slots
are taken (`active_sessions`) of how many (`max_sessions`). `slot_load(url)` is that fraction, read
over HTTP with the standard library, so a LiveKit Agents worker (or any dispatcher that balances on a
0..1 load) can report the model server's real occupancy:

* 200 from /healthz: `active_sessions / max_sessions`, clamped to [0, 1] (`status` "busy" is 1.0);
* 503 (`status` "unavailable": the model is loading or failed) or no answer (refused, timeout,
  DNS): 1.0, full. A machine whose model server does not answer takes no new conversation; the
  worker reports it full until the server answers again (a warning is logged each time);
* an answer that is not voicechat's /healthz (not JSON, no slot counts, `max_sessions` < 1):
  `SlotLoadError`, naming the URL and what is wrong: the URL points at something else, which a
  retry does not fix.

`slot_load_fnc(url)` is the function to give LiveKit's `AgentServer(load_fnc=...)` (or
`WorkerOptions`): it never raises (LiveKit's load loop stops at the first exception of its
load_fnc), a `SlotLoadError` is logged and reported as 1.0; and it counts the worker's own jobs too,
`max(active_sessions, jobs) / max_sessions`, since a job LiveKit just assigned takes its slot only
when its session connects.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("voicechat.load")

FULL = 1.0
_SCHEMES = {"ws": "http", "wss": "https", "http": "http", "https": "https"}


class SlotLoadError(ValueError):
    """The URL answered, but not as voicechat's /healthz does."""


def healthz_url(base_url: str) -> str:
    """`http(s)://host:port/healthz` for a server URL as a client names it: `http://host:port`,
    `http://host:port/v1`, `ws://host:port/v1` (LiveKit's and the openai SDK's base_url),
    `ws://host:port/v1/realtime`; the path and query are dropped, ws -> http, wss -> https."""
    parts = urlsplit(base_url)
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        raise ValueError(
            f"not a server URL: {base_url!r}; expected http(s)://HOST:PORT or ws(s)://HOST:PORT[/v1] "
            "(the `voicechat serve` address)"
        )
    return urlunsplit((scheme, parts.netloc, "/healthz", "", ""))


def read_slots(base_url: str, timeout: float = 2.0) -> tuple[int, int] | None:
    """(active_sessions, max_sessions) from /healthz, or None when the server does not answer or
    says it is unavailable (503). SlotLoadError when the answer is not voicechat's /healthz."""
    url = healthz_url(base_url)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # http(s) only: healthz_url
            status, body = r.status, r.read(65536)
    except urllib.error.HTTPError as e:  # 4xx / 5xx: urllib raises, the body is still there
        status, body = e.code, e.read(65536)
        if status == 503:
            log.warning("%s: the model server is unavailable (503); reporting the machine full", url)
            return None
        raise SlotLoadError(f"{url} answered HTTP {status}, not voicechat's /healthz (200 or 503)") from None
    except (urllib.error.URLError, OSError) as e:  # refused, unreachable, DNS, timeout
        reason = getattr(e, "reason", e)
        log.warning("%s did not answer (%s); reporting the machine full", url, reason)
        return None
    try:
        data: object = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise SlotLoadError(f"{url} answered HTTP {status} with a body that is not JSON: {body[:80]!r}") from None
    fields = cast("dict[str, object]", data) if isinstance(data, dict) else {}
    active, slots = _count(fields.get("active_sessions")), _count(fields.get("max_sessions"))
    if active is None or slots is None or slots < 1:
        raise SlotLoadError(
            f"{url} answered without voicechat's slot counts: expected integers active_sessions >= 0 and "
            f"max_sessions >= 1, got active_sessions={fields.get('active_sessions')!r}, "
            f"max_sessions={fields.get('max_sessions')!r}"
        )
    return active, slots


def _count(v: object) -> int | None:
    """A JSON count (an int >= 0, not a bool), or None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def slot_load(base_url: str, timeout: float = 2.0) -> float:
    """active_sessions / max_sessions of the `voicechat serve` at `base_url`, in [0, 1]; 1.0 when it does
    not answer or is unavailable; SlotLoadError when the answer is not voicechat's /healthz."""
    slots = read_slots(base_url, timeout)
    if slots is None:
        return FULL
    active, n = slots
    return min(active / n, FULL)


def slot_load_fnc(base_url: str, timeout: float = 2.0) -> Callable[[Any], float]:
    """LiveKit Agents' `load_fnc` for a worker in front of the `voicechat serve` at `base_url`.

    LiveKit calls it with the AgentServer (every 0.5 s and before it answers a job request); the
    load is max(active_sessions, the worker's active jobs) / max_sessions. It never raises: an
    exception would stop LiveKit's load loop, so every failure is logged and reported as 1.0 (full).
    Pair it with `load_threshold=1.0`: LiveKit takes a job while load < load_threshold, so the worker
    is available while a slot is free and full when all are taken."""

    def load(server: Any = None) -> float:
        try:
            slots = read_slots(base_url, timeout)
        except Exception as e:  # SlotLoadError, or a bad URL: full, and said
            log.error("slot load: %s; reporting the machine full", e)
            return FULL
        if slots is None:
            return FULL
        active, n = slots
        jobs = _jobs(server)
        return min(max(active, jobs) / n, FULL)

    return load


def _jobs(server: Any) -> int:
    try:
        return len(server.active_jobs) if server is not None else 0
    except Exception:  # an AgentServer before run() has no process pool yet
        return 0
