"""Who runs the tools the model calls: Python callables, or an MCP server over stdio.

A runner lists its tools in the OpenAI function form the session takes (`tools()`) and executes
one call (`call(name, arguments) -> JSON text`), blocking, off the MLX thread. The result text goes
back with `session.submit_tool_result`. Failures become a JSON error result, so the model hears of
them; nothing is raised into the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import shlex
import threading
import typing
from pathlib import Path


def _result_text(value) -> str:
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except json.JSONDecodeError:
            return json.dumps(value)
    return json.dumps(value)


def _error(message: str) -> str:
    return json.dumps({"error": message})


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _schema_of(annotation) -> dict:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _schema_of(args[0]) if len(args) == 1 else {}
    base = origin or annotation
    return {"type": _JSON_TYPES[base]} if base in _JSON_TYPES else {}


class PythonToolRunner:
    """A registry of Python callables: `runner.register(fn)` or `@runner.register` (schema from the
    signature's annotations, description from the docstring's first paragraph, when not given)."""

    def __init__(self, functions: dict | None = None):
        self._tools: dict[str, tuple[typing.Callable, dict]] = {}
        for name, fn in (functions or {}).items():
            self.register(fn, name=name)

    def register(self, fn=None, *, name=None, description=None, parameters=None):
        if fn is None:
            return lambda f: self.register(f, name=name, description=description, parameters=parameters)
        name = name or fn.__name__
        if parameters is None:
            hints = typing.get_type_hints(fn)
            props, required = {}, []
            for p in inspect.signature(fn).parameters.values():
                props[p.name] = _schema_of(hints.get(p.name, inspect.Parameter.empty))
                if p.default is inspect.Parameter.empty:
                    required.append(p.name)
            parameters = {"type": "object", "properties": props, **({"required": required} if required else {})}
        if description is None:
            description = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ").strip()
        tool = {"type": "function", "name": name, "parameters": parameters}
        if description:
            tool["description"] = description
        self._tools[name] = (fn, tool)
        return fn

    def tools(self) -> list[dict]:
        return [json.loads(json.dumps(t)) for _, t in self._tools.values()]

    def call(self, name: str, arguments: dict, *, timeout: float | None = None) -> str:
        if name not in self._tools:
            raise ValueError(f"unknown tool {name!r}; known: {', '.join(self._tools) or 'none'}")
        try:
            return _result_text(self._tools[name][0](**arguments))
        except Exception as e:  # the model hears about the failure
            return _error(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class McpToolRunner:
    """An MCP server started over stdio (`command`, e.g. "python -m mcp_server_time"): `tools/list` at
    start, `tools/call` per call. The client runs on a private event loop in a daemon thread."""

    def __init__(self, command, *, env: dict | None = None, startup_timeout: float = 30.0):
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        if not self.command:
            raise ValueError("the MCP server command is empty")
        self._env = env
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="voicechat-mcp", daemon=True)
        self._thread.start()
        self._stop: asyncio.Event | None = None
        self._session = None
        self._errlog = None
        self._main = None
        self._tools: list[dict] = []
        ready = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            ready.result(startup_timeout)
        except BaseException as e:
            tail = self._stderr_tail()
            self.close()
            raise RuntimeError(
                f"MCP server {shlex.join(self.command)!r} did not start ({type(e).__name__}: {e})"
                + (f"; its stderr ends with:\n{tail}" if tail else "")
            ) from None

    def _stderr_tail(self) -> str:
        if self._errlog is None:
            return ""
        try:
            self._errlog.flush()
            self._errlog.seek(0)
            return "\n".join(self._errlog.read().decode("utf-8", "replace").splitlines()[-10:])
        except (OSError, ValueError):
            return ""

    async def _start(self) -> None:
        import tempfile

        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        started = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._errlog = tempfile.TemporaryFile()  # noqa: SIM115 - the server's stderr for its whole life; closed in close()

        async def main():
            params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self._env)
            try:
                async with (
                    stdio_client(params, errlog=self._errlog) as (read, write),
                    ClientSession(read, write) as session,
                ):
                    await session.initialize()
                    listed = await session.list_tools()
                    self._tools = [_openai_tool(t) for t in listed.tools]
                    self._session = session
                    started.set_result(None)
                    await self._stop.wait()
            except BaseException as e:  # reported to the starter, or later calls see a closed session
                if not started.done():
                    started.set_exception(e)
                self._session = None

        self._main = asyncio.ensure_future(main())
        await started

    def tools(self) -> list[dict]:
        return [json.loads(json.dumps(t)) for t in self._tools]

    def call(self, name: str, arguments: dict, *, timeout: float | None = None) -> str:
        known = [t["name"] for t in self._tools]
        if name not in known:
            raise ValueError(f"unknown tool {name!r}; the MCP server offers: {', '.join(known)}")
        if self._session is None:
            return _error("the MCP server is closed")
        fut = asyncio.run_coroutine_threadsafe(self._session.call_tool(name, arguments), self._loop)
        try:
            result = fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            return _error("timeout")
        except Exception as e:
            return _error(f"{type(e).__name__}: {e}")
        if result.structured_content is not None:
            text = json.dumps(result.structured_content)
        else:
            text = "".join(getattr(c, "text", "") for c in result.content)
        if result.is_error:
            return _error(text or "the tool failed")
        return _result_text(text)

    def close(self) -> None:
        """End the session and the server process (the stdio client waits for it, then kills it)."""
        if self._loop.is_closed():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._main is not None:
            done = asyncio.run_coroutine_threadsafe(asyncio.wait({self._main}, timeout=10), self._loop)
            with contextlib.suppress(Exception):
                done.result(15)
        self._session = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _openai_tool(t) -> dict:
    tool = {"type": "function", "name": t.name, "parameters": dict(t.input_schema or {"type": "object"})}
    if t.description:
        tool["description"] = t.description
    return tool


def tools_from_file(path) -> list[dict]:
    """A tools.json: a JSON list of OpenAI function tools (flat, or nested `{"type": "function",
    "function": {...}}`, normalised to flat)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a tools list ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of function tools, got {type(data).__name__}")
    out = []
    for i, t in enumerate(data):
        if not isinstance(t, dict):
            raise ValueError(f"{path}: entry {i} is not an object")
        d = dict(t["function"]) if isinstance(t.get("function"), dict) else {k: v for k, v in t.items() if k != "type"}
        if not isinstance(d.get("name"), str):
            raise ValueError(f"{path}: entry {i} has no string 'name'")
        out.append({"type": "function", **d})
    return out
