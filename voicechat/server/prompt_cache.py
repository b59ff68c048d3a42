"""The server's prompt states (voicechat/streaming/prompt_state.py): the default prompt's state prepared at
startup, and a small LRU of the states of the prompts clients ask for.

A session whose prompt (system prompt, tools, seed) has a state starts from a copy of it, so the
worker answers its `session.update` with `session.updated` without a prefill; a new prompt is
prefilled once into a state (the session starts from it, bit for bit as a prefilling session) and
kept for the next client. Bounded by entries and bytes (`--prompt-cache-entries`, `--prompt-cache-mb`);
the default prompt's state is pinned. Used on the MLX worker thread only.
"""

from __future__ import annotations

import json
import sys
import time
from collections import OrderedDict

from voicechat.streaming.prompt_state import PromptState
from voicechat.streaming.timeline import session_prompt
from voicechat.tools.channel import normalize_tools


class PromptStates:
    def __init__(
        self,
        *,
        default_prompt=None,
        default_tools=None,
        state_file=None,
        max_entries: int = 4,
        max_bytes: int = 1 << 30,
        metrics=None,
        announce=True,
    ):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
            raise ValueError(f"prompt cache entries must be an int >= 0, got {max_entries!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prompt cache bytes must be an int >= 0, got {max_bytes!r}")
        self.default_prompt = default_prompt
        self.default_tools = default_tools
        self.state_file = state_file
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.announce = announce
        self._lru: OrderedDict = OrderedDict()
        self._pinned = None  # (key, state) of the default prompt
        self._gauges = _Gauges(metrics) if metrics is not None else None

    # -- keys

    def _key(self, model, system_prompt, tools, seed) -> tuple:

        tools = normalize_tools(tools)
        text = session_prompt(model.config, system_prompt, tools)
        text = model.config.default_system_prompt if text is None else text
        return text, json.dumps(tools, sort_keys=True), int(seed)

    def _resolve(self, system_prompt, tools):
        return (
            self.default_prompt if system_prompt is None else system_prompt,
            self.default_tools if tools is None else tools,
        )

    # -- startup (worker thread)

    def start(self, model) -> None:
        """Prepare (or load, with a state file) the default prompt's state; one progress line each way."""

        t0 = time.perf_counter()
        if self.state_file is not None:
            state = PromptState.load(self.state_file, model)
            if self.default_prompt is not None and state.system_prompt != self.default_prompt:
                raise ValueError(
                    f"--prompt-state {self.state_file} holds the prompt {state.system_prompt!r}, not "
                    f"-p {self.default_prompt!r}; leave -p out or write the file for it"
                )
            self.default_prompt = state.system_prompt
            self.default_tools = list(state.tools) or None
            how = f"read from {self.state_file}"
            key = self._key(model, state.system_prompt, state.tools, state.seed)
        else:
            self._say("preparing the default prompt's state (its prefill, once) ...")
            state = model.prepare_prompt(self.default_prompt, tools=self.default_tools)
            how = "prepared"
            key = self._key(model, self.default_prompt, self.default_tools, 0)
        self._pinned = (key, state)
        self._say(
            f"default prompt state {how}: {state.prompt_positions} positions, "
            f"{state.nbytes / 2**20:.2f} MiB, in {time.perf_counter() - t0:.2f} s"
        )
        self._update_gauges(state)

    def _say(self, msg: str) -> None:
        if self.announce:
            print(f"voicechat serve: {msg}", file=sys.stderr, flush=True)

    # -- sessions (worker thread)

    def state_for(self, model, system_prompt, seed: int, tools=None, should_stop=None):
        """The state of this prompt: the pinned or a cached one, else prepared now (and cached);
        `should_stop` stops that prefill (`PrefillStoppedError`)."""
        system_prompt, tools = self._resolve(system_prompt, tools)
        key = self._key(model, system_prompt, tools, seed)
        if self._pinned is not None and self._pinned[0] == key:
            self._count("hit")
            return self._pinned[1]
        state = self._lru.get(key)
        if state is not None:
            self._lru.move_to_end(key)
            self._count("hit")
            return state
        self._count("miss")
        state = model.prepare_prompt(system_prompt, tools=tools, seed=seed, should_stop=should_stop)
        if self.max_entries and state.nbytes <= self.max_bytes:
            self._lru[key] = state
            while len(self._lru) > self.max_entries or self.cached_bytes > self.max_bytes:
                self._lru.popitem(last=False)
        self._update_gauges(state)
        return state

    @property
    def cached_bytes(self) -> int:
        return sum(s.nbytes for s in self._lru.values())

    @property
    def entries(self) -> int:
        return len(self._lru)

    def _count(self, result: str) -> None:
        if self._gauges is not None:
            self._gauges.lookups.labels(result=result).inc()

    def _update_gauges(self, last) -> None:
        g = self._gauges
        if g is None:
            return
        g.state_bytes.set(self._pinned[1].nbytes if self._pinned is not None else last.nbytes)
        g.entries.set(len(self._lru))
        g.cached_bytes.set(self.cached_bytes)


class _Gauges:
    """Prometheus series of the prompt states, on the server's own registry."""

    def __init__(self, metrics):
        from prometheus_client import Counter, Gauge

        r = metrics.registry
        self.state_bytes = Gauge(
            "voicechat_prompt_state_bytes", "bytes of one prompt state (the default prompt's; state.nbytes)", registry=r
        )
        self.entries = Gauge(
            "voicechat_prompt_cache_entries", "prompt states in the LRU (besides the default)", registry=r
        )
        self.cached_bytes = Gauge("voicechat_prompt_cache_bytes", "bytes of the prompt states in the LRU", registry=r)
        self.lookups = Counter(
            "voicechat_prompt_cache_lookups", "session prompts looked up in the prompt states", ["result"], registry=r
        )
        for result in ("hit", "miss"):
            self.lookups.labels(result=result)


__all__ = ["PromptStates"]
