"""The server's prompt states (voicechat/server/prompt_cache.py): the default prompt's state made at
startup, an LRU for the prompts clients send, sessions from states equal to prefilling ones on the
wire, `session.updated` without a prefill for a cached prompt, the bytes in /metrics."""

from __future__ import annotations

import time
import urllib.request

import pytest

pytest.importorskip("starlette")

from voicechat.server.client import run_stream_audio, to_pcm16

from .server_util import Raw, run, stop_server, wait_released
from .test_server import _expected_events, _wire_events

# ~580 prompt positions at the tiny preset: a prefill long enough to tell from a cached start.
LONG = " ".join(["You are a patient assistant for a hardware store; answer in one short sentence."] * 12)


def _start(ckpt, **kw):
    from voicechat.server.limits import ServerLimits
    from voicechat.server.metrics import ServerMetrics
    from voicechat.server.prompt_cache import PromptStates
    from voicechat.server.runner import ServerThread, make_state

    metrics = ServerMetrics()
    prompts = PromptStates(metrics=metrics, announce=False, **kw)
    # LONG is ~580 tokens of the tiny tokenizer: above the default --max-prompt-tokens (512).
    state = make_state(
        str(ckpt),
        warmup_seconds=0.0,
        prompt_states=prompts,
        metrics=metrics,
        limits=ServerLimits(max_prompt_tokens=2048),
    )
    return ServerThread(state).start(), prompts


def _metrics(srv) -> dict:
    text = urllib.request.urlopen(srv.http + "/metrics").read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


async def _update_latency(url, session: dict) -> float:
    """Seconds from sending session.update to receiving session.updated."""
    async with Raw(url) as c:
        assert (await c.recv())["type"] == "session.created"
        t = time.perf_counter()
        await c.send({"type": "session.update", "session": session})
        e = await c.recv()
        dt = time.perf_counter() - t
        assert e["type"] == "session.updated", e
        return dt


def test_default_prompt_state_and_lru(tiny_ckpt, tiny_model, question_wav):
    srv, prompts = _start(tiny_ckpt, default_prompt=LONG, max_entries=1)
    try:
        pinned = prompts._pinned[1]
        assert pinned.prompt_positions > 250
        m = _metrics(srv)
        assert m["voicechat_prompt_state_bytes"] == pinned.nbytes > 0
        # A client without a prompt gets the default one, from its state: the wire equals a prefilling session.
        pcm = to_pcm16(question_wav[: 1280 * 8])
        r = run_stream_audio(srv.url, pcm, fast=True, chunk_samples=1280)
        assert r.end == "response.done" and not r.errors
        assert _wire_events(r) == _expected_events(tiny_model, pcm, prompt=LONG)
        wait_released(srv)
        cached = run(_update_latency(srv.url, {}))
        wait_released(srv)
        m = _metrics(srv)
        assert m['voicechat_prompt_cache_lookups_total{result="hit"}'] == 2
        assert m['voicechat_prompt_cache_lookups_total{result="miss"}'] == 0
        # A new prompt is prefilled once, then cached (one entry: the LRU drops the older one).
        t = time.perf_counter()
        tiny_model.prepare_prompt(LONG + " Be kind.")
        prefill = time.perf_counter() - t
        first = run(_update_latency(srv.url, {"instructions": LONG + " Be kind."}))
        wait_released(srv)
        second = run(_update_latency(srv.url, {"instructions": LONG + " Be kind."}))
        wait_released(srv)
        run(_update_latency(srv.url, {"instructions": "Be brief."}))
        wait_released(srv)
        m = _metrics(srv)
        assert m['voicechat_prompt_cache_lookups_total{result="hit"}'] == 3
        assert m['voicechat_prompt_cache_lookups_total{result="miss"}'] == 2
        assert m["voicechat_prompt_cache_entries"] == prompts.entries == 1
        assert m["voicechat_prompt_cache_bytes"] == prompts.cached_bytes > 0
        print(
            f"session.update -> session.updated: cached default {cached * 1000:.1f} ms, new prompt "
            f"{first * 1000:.1f} ms (its prefill {prefill * 1000:.0f} ms), cached {second * 1000:.1f} ms"
        )
        # No prefill for a cached prompt (generous bounds: other processes share this CPU).
        assert cached < 0.5 and second < 0.5 and second < first
    finally:
        stop_server(srv)


def test_prompt_state_file_is_the_default(tiny_ckpt, tiny_model, tmp_path, question_wav):
    path = tiny_model.prepare_prompt("Be brief.", seed=0).save(tmp_path / "p.safetensors")
    srv, prompts = _start(tiny_ckpt, state_file=path)
    try:
        assert prompts.default_prompt == "Be brief."
        pcm = to_pcm16(question_wav[: 1280 * 5])
        r = run_stream_audio(srv.url, pcm, fast=True, chunk_samples=1280)
        assert _wire_events(r) == _expected_events(tiny_model, pcm, prompt="Be brief.")
        assert _metrics(srv)['voicechat_prompt_cache_lookups_total{result="hit"}'] == 1
    finally:
        stop_server(srv)


def test_state_file_for_another_checkpoint_stops_the_start(tiny_ckpt_4bit, tiny_model, tmp_path):
    from voicechat.errors import PromptStateError

    path = tiny_model.prepare_prompt("Be brief.").save(tmp_path / "p.safetensors")
    with pytest.raises(PromptStateError, match="another checkpoint"):
        _start(tiny_ckpt_4bit, state_file=path)
