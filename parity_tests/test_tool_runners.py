"""Tool runners (voicechat/tools/runners.py): Python callables and a real MCP server over stdio."""

from __future__ import annotations

import datetime as dt
import json
import sys

import numpy as np
import pytest

from parity_tests.conftest import TOOLCALL_ARGUMENTS
from voicechat.tools.runners import McpToolRunner, PythonToolRunner, tools_from_file

TIME_SERVER = [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]


def test_python_runner_schema_and_results():
    r = PythonToolRunner()

    @r.register
    def add(a: int, b: int = 2) -> int:
        """Add two integers.

        More text."""
        return a + b

    r.register(lambda: "not json", name="plain")
    r.register(lambda: '{"x": 1}', name="jsontext")
    r.register(lambda: 1 / 0, name="boom")
    tool = r.tools()[0]
    assert tool == {
        "type": "function",
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a"],
        },
    }
    assert json.loads(r.call("add", {"a": 1})) == 3
    assert r.call("plain", {}) == '"not json"' and r.call("jsontext", {}) == '{"x": 1}'
    assert json.loads(r.call("boom", {})) == {"error": "ZeroDivisionError: division by zero"}
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        r.call("nope", {})


@pytest.fixture(scope="module")
def time_server():
    with McpToolRunner(TIME_SERVER) as r:
        yield r


def test_mcp_time_server_lists_and_calls(time_server):
    tools = {t["name"]: t for t in time_server.tools()}
    assert {"get_current_time", "convert_time"} <= set(tools)
    assert tools["get_current_time"]["parameters"]["properties"]["timezone"]["type"] == "string"
    out = json.loads(time_server.call("get_current_time", {"timezone": "UTC"}))
    when = dt.datetime.fromisoformat(out["datetime"])
    assert abs((when - dt.datetime.now(dt.UTC)).total_seconds()) < 60
    with pytest.raises(ValueError, match="offers"):
        time_server.call("get_weather", {})
    assert "error" in json.loads(time_server.call("get_current_time", {"timezone": "Not/AZone"}))


def test_mcp_bad_command_reports_stderr():
    with pytest.raises(RuntimeError, match=r"(?s)did not start.*stderr ends with:\nboom"):
        McpToolRunner([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"], startup_timeout=20)


def test_mcp_close_reaps_the_server():
    import subprocess

    r = McpToolRunner(TIME_SERVER)
    r.close()
    out = subprocess.run(
        ["pgrep", "-f", "mcp_server_time --local-timezone UTC"], capture_output=True, text=True, check=False
    )
    alive = list(out.stdout.split())
    # Only the module-scoped fixture's server (if it is running) may remain.
    assert len(alive) <= 1, out.stdout


def test_tools_from_file(tmp_path):
    p = tmp_path / "tools.json"
    p.write_text(
        json.dumps(
            [
                {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
                {"type": "function", "name": "b"},
            ]
        )
    )
    assert tools_from_file(p) == [
        {"type": "function", "name": "a", "parameters": {"type": "object"}},
        {"type": "function", "name": "b"},
    ]
    p.write_text(json.dumps([{"description": "no name"}]))
    with pytest.raises(ValueError, match="entry 0 has no string 'name'"):
        tools_from_file(p)


def test_mcp_call_result_injected_into_the_session(toolcall_model, time_server):
    """The whole loop with a real MCP server: the model's get_current_time call is executed by
    mcp-server-time and its result forced onto the function channel, then the model's EOTR."""
    s = toolcall_model.create_streaming_session(tools=time_server.tools())
    events, results = [], {}
    wave = np.zeros(1280 * 240, np.float32)
    for i in range(0, wave.size, 1280):
        for e in s.push_audio(wave[i : i + 1280]):
            events.append(e)
            if e.kind == "tool_call":
                assert e.name == "get_current_time" and e.arguments == TOOLCALL_ARGUMENTS
                results[e.call_id] = time_server.call(e.name, e.arguments)
                s.submit_tool_result(e.call_id, results[e.call_id])
    done = [e for e in events if e.kind == "tool_result_done"]
    assert len(results) == 1 and [e.call_id for e in done] == list(results)
    assert "datetime" in json.loads(next(iter(results.values())))
