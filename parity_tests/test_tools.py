"""Tool calls over the function channel (voicechat.tools, docs/tools.md).

The renderer is checked against the bytes of NVIDIA's pinned rendering written out here; the call
state machine on token sequences with a fake tokenizer; the whole loop (prefill with tools, call,
result injection, EOTR) on the `toolcall` preset, streamed and offline."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.conftest import TIME_TOOL, TOOLCALL_ARGUMENTS, TOOLCALL_TOOL
from voicechat.tools.channel import FunctionChannel, render_system_prompt

FOOTER = (
    "</AVAILABLE_TOOLS>\n\nIf you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, {"name": "tool_name2", '
    '"arguments": "tool_args2"}]</TOOLCALL>\n\nThe user will execute tool-calls and return responses '
    'from tool(s) in this format:\n<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>'
    "\n\nBased on the tool responses, you can call additional tools if needed, correct tool calls if any "
    "errors are found, or just respond to the user."
)
HEADER = "You can use the following tools to assist the user if required:\n<AVAILABLE_TOOLS>["

WEATHER = {
    "name": "get_weather",
    "description": "Get current weather for a city",
    "ack_messages": None,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def test_render_one_tool_byte_for_byte():
    tool = dict(WEATHER)
    del tool["ack_messages"]
    expected = (
        "Be helpful.\n\n"
        + HEADER
        + '{"description": "Get current weather for a city", "name": "get_weather", "parameters": '
        '{"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}]' + FOOTER
    )
    assert render_system_prompt("Be helpful.", [tool]) == expected


def test_render_three_and_five_tools_byte_for_byte():
    tool = {k: v for k, v in WEATHER.items() if k != "ack_messages"}
    three = [tool, ADD, {"type": "function", "name": "ping"}]
    expected3 = (
        HEADER + '{"description": "Get current weather for a city", "name": "get_weather", "parameters": '
        '{"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}, '
        '{"description": "Add two integers", "name": "add", "parameters": {"properties": {"a": '
        '{"type": "integer"}, "b": {"type": "integer"}}, "type": "object"}}, {"name": "ping"}]' + FOOTER
    )
    assert render_system_prompt(None, three) == expected3  # no base prompt: no blank line before the block
    five = [{"name": f"t{i}", "description": f"tool {i}"} for i in range(5)]
    expected5 = (
        "Hi\n\n" + HEADER + ", ".join(f'{{"description": "tool {i}", "name": "t{i}"}}' for i in range(5)) + "]" + FOOTER
    )
    assert render_system_prompt("Hi", five) == expected5
    assert render_system_prompt("Hi", None) == "Hi" and render_system_prompt("Hi", []) == "Hi"


@pytest.mark.parametrize(
    "tools, message",
    [
        ([{"name": f"t{i}"} for i in range(6)], "at most 5 tools"),
        ([{"name": "caf\u00e9"}], "letters, digits"),
        ([{"name": "x", "description": "d\u00e9j\u00e0"}], "non-ASCII"),
        ([{"name": "x"}, {"type": "function", "function": {"name": "x"}}], "duplicate"),
        ([{"type": "retrieval", "name": "x"}], "type must be 'function'"),
        ([{"name": "x", "parameters": {"type": "array"}}], "JSON-schema object"),
    ],
)
def test_bad_tool_lists_are_refused(tools, message):
    with pytest.raises(ValueError, match=message):
        render_system_prompt("p", tools)


class CharTokenizer:
    """Ids 0-31 specials (20-22 the markers), then one id per ASCII character."""

    def get_vocab(self):
        return {f"<SPECIAL_{i}>": i for i in range(32)} | {chr(c): 32 + c for c in range(128)}

    def encode(self, text):
        return [32 + ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i - 32) if i >= 32 else f"<SPECIAL_{i}>" for i in ids)


PAD, SOTC, EOTC, EOTR = 12, 20, 21, 22
TOOLS = ({"name": "get_weather"}, {"name": "add"})


def feed(ch, tokens, start=0):
    events = []
    for i, t in enumerate(tokens):
        events += ch.observe(start + i, t, False)
    return events


def call_tokens(text):
    return [SOTC] + [x for c in CharTokenizer().encode(text) for x in (c, PAD)] + [EOTC]  # PADs inside are dropped


def channel(**kw):
    return FunctionChannel(CharTokenizer(), TOOLS, pad_id=PAD, **kw)


def test_call_list_parsed_with_wrapper_and_string_arguments():
    ch = channel()
    text = (
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", '
        '"arguments": "{\\"a\\": 2, \\"b\\": 3}"}]</TOOLCALL>'
    )
    toks = call_tokens(text)
    ev = feed(ch, toks)
    assert [e.kind for e in ev] == ["tool_call", "tool_call"]
    end = len(toks) - 1
    assert [e.call_id for e in ev] == [f"call_{end}_0", f"call_{end}_1"]
    assert ev[0].arguments == {"city": "Paris"} and ev[1].arguments == {"a": 2, "b": 3} and ev[0].raw == text
    assert ch.pending_call_ids == [f"call_{end}_0", f"call_{end}_1"]
    ch.submit(f"call_{end}_1", "5")
    assert ch.forced_token(end + 1) is None  # waits for every result of the list
    ch.submit(f"call_{end}_0", {"temp": 20})
    forced = []
    while (t := ch.forced_token(end + 1 + len(forced))) is not None:
        forced.append(t)
    # the str as given, the value as json.dumps writes it, joined as the tools block's template shows
    assert CharTokenizer().decode(forced) == '<TOOL_RESPONSE>[{"temp": 20}, 5]</TOOL_RESPONSE>'
    assert ch.observe(200, EOTR, False)[0].kind == "tool_result_done"
    assert ch.state == "idle"


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([EOTC], "EOTC without SOTC"),
        ([EOTR], "EOTR without a tool call"),
        ([SOTC, 40, SOTC], "nested SOTC"),
        ([SOTC, 40, EOTR], "EOTR before EOTC"),
        (call_tokens("not json"), "not valid JSON"),
        (call_tokens('[{"name": "invented", "arguments": {}}]'), "unknown tool 'invented'"),
        (call_tokens('[{"name": "add", "arguments": [1]}]'), "must be a JSON object"),
        (call_tokens('[{"name": "add", "arguments": NaN}]'), "not valid JSON"),
        ([SOTC] + [40] * 513, "longer than 512 tokens"),
    ],
)
def test_malformed_sequences_give_an_error_and_reset(tokens, message):
    ch = channel()
    ev = feed(ch, tokens)
    assert [e.kind for e in ev] == ["tool_call_error"], ev
    assert message in ev[0].message
    assert ch.state == "idle"
    assert [e.kind for e in feed(ch, call_tokens('[{"name": "add"}]'), 600)] == ["tool_call"]  # goes on


def test_markers_while_a_call_is_pending_are_errors():
    ch = channel()
    feed(ch, call_tokens('[{"name": "add"}]'))
    assert "before the tool result" in feed(ch, [EOTR], 100)[0].message
    assert "SOTC while an earlier call" in feed(ch, [SOTC], 101)[0].message
    assert ch.state == "awaiting_results"


def test_results_for_unknown_or_answered_calls_change_nothing():
    ch = channel()
    feed(ch, call_tokens('[{"name": "add"}]'))
    cid = ch.pending_call_ids[0]
    with pytest.raises(ValueError, match="not a pending tool call"):
        ch.submit("call_0_0", "{}")
    assert ch.pending_call_ids == [cid] and ch.state == "awaiting_results"
    ch.submit(cid, "[1, 2]")
    with pytest.raises(ValueError, match="already answered"):
        ch.submit(cid, "{}")
    forced = []
    while (t := ch.forced_token(len(forced) + 100)) is not None:
        forced.append(t)
    assert CharTokenizer().decode(forced) == "<TOOL_RESPONSE>[[1, 2]]</TOOL_RESPONSE>"  # the str exactly as given


@pytest.mark.parametrize(
    "output, text",
    [
        ('{"temp":20,  "unit":"C"}', '{"temp":20,  "unit":"C"}'),  # spacing kept: not parsed and re-dumped
        ("sunny, 20 °C", "sunny, 20 °C"),  # not JSON, not quoted, not escaped
        ({"b": 1, "a": [1.5, None]}, '{"b": 1, "a": [1.5, null]}'),  # json.dumps, default separators
    ],
)
def test_a_str_result_goes_in_as_given_and_a_value_as_json_dumps(output, text):
    ch = channel()
    feed(ch, call_tokens('[{"name": "add"}]'))
    ch.submit(ch.pending_call_ids[0], output)
    forced = []
    while (t := ch.forced_token(len(forced) + 100)) is not None:
        forced.append(t)
    assert CharTokenizer().decode(forced) == f"<TOOL_RESPONSE>[{text}]</TOOL_RESPONSE>"


def test_timeout_injects_an_error_result_after_its_frames():
    ch = channel(timeout_frames=3)
    feed(ch, call_tokens('[{"name": "add"}]'))
    f = ch.call_frame
    assert [ch.forced_token(f + k) for k in (1, 2, 3)] == [None, None, None]
    first = ch.forced_token(f + 4)
    assert first == CharTokenizer().encode("<")[0]
    rest = []
    while (t := ch.forced_token(f + 5 + len(rest))) is not None:
        rest.append(t)
    assert CharTokenizer().decode([first] + rest) == '<TOOL_RESPONSE>[{"error": "timeout"}]</TOOL_RESPONSE>'


def test_tools_are_refused_without_the_markers(tiny_model):
    with pytest.raises(ValueError, match="lacks the function channel's tool markers"):
        tiny_model.create_streaming_session(tools=[TIME_TOOL])


# -- the whole loop on the toolcall preset


def _script_len(model):
    from voicechat.synthetic.toolcall import ToolcallScript

    return len(ToolcallScript(model.tokenizer._tok, TOOLCALL_TOOL, TOOLCALL_ARGUMENTS).script)


def _stream(model, submit_after, wave, chunk=1280, result='{"datetime": "2026-12-03T12:00:00+00:00"}'):
    records = []
    s = model.create_streaming_session(tools=[TIME_TOOL], on_frame=records.append)
    events = []
    for i in range(0, wave.size, chunk):
        ev = s.push_audio(wave[i : i + chunk])
        events += ev
        if s.frame_index - 1 == submit_after and s.pending_tool_calls:
            s.submit_tool_result(s.pending_tool_calls[0], result)
        elif (
            s.frame_index > 0 and submit_after is not None and s.frame_index - 1 > submit_after and s.pending_tool_calls
        ):
            raise AssertionError("the schedule's frame passed inside one push; use smaller pushes")
    events += s.flush()
    return s, events, records


def test_toolcall_preset_streamed_timeline(toolcall_model):
    n = _script_len(toolcall_model)
    wave = np.zeros(1280 * 200, np.float32)
    submit_after = n + 5
    _s, events, records = _stream(toolcall_model, submit_after, wave)
    calls = [e for e in events if e.kind == "tool_call"]
    assert len(calls) == 1 and calls[0].frame_index == n < 100
    assert calls[0].name == TOOLCALL_TOOL and calls[0].arguments == TOOLCALL_ARGUMENTS
    assert calls[0].call_id == f"call_{n}_0"
    assert records[1].function_fed == 20 and records[n].function_fed == 21  # SOTC at frame 1, EOTC at frame n
    forced = [r.frame_index for r in records if r.forced]
    response = toolcall_model.tokenizer.encode(
        '<TOOL_RESPONSE>[{"datetime": "2026-12-03T12:00:00+00:00"}]</TOOL_RESPONSE>'
    )
    assert forced == list(range(submit_after + 1, submit_after + 1 + len(response)))
    assert [records[f].function_fed for f in forced] == response
    assert all(records[f].text_fed == 12 for f in forced)  # text forced to PAD
    done = [e for e in events if e.kind == "tool_result_done"]
    assert [(e.frame_index, e.call_id) for e in done] == [(forced[-1] + 1, calls[0].call_id)]
    assert records[forced[-1] + 1].function_id == 22 and not records[forced[-1] + 1].forced  # the model's own EOTR
    assert not [e for e in events if e.kind == "tool_call_error"]


def test_toolcall_streamed_equals_offline_for_the_schedule(toolcall_model):
    n = _script_len(toolcall_model)
    wave = np.zeros(1280 * 180 + 300, np.float32)
    s, events, records = _stream(toolcall_model, n + 2, wave, chunk=997)
    result = '{"datetime": "2026-12-03T12:00:00+00:00"}'
    off = toolcall_model.generate(wave, tools=[TIME_TOOL], tool_results=[(n + 2, f"call_{n}_0", result)])
    k = len(s.text_ids)
    assert np.array_equal(off.text_tokens[:k], s.text_ids) and np.array_equal(off.function_tokens[:k], s.function_ids)
    assert np.array_equal(off.raw_audio_codes[:k], np.stack(s.raw_audio_codes))
    assert off.forced[:k].tolist() == [r.forced for r in records]
    streamed = [e for e in events if e.kind.startswith("tool_")]
    assert [e for e in off.tool_events if e.frame_index < k] == streamed and len(streamed) == 2


def test_push_sizes_do_not_change_the_events(toolcall_model):
    n = _script_len(toolcall_model)
    wave = np.zeros(1280 * (n + 40), np.float32)
    kinds = []
    for chunk in (1280, 640, 333):
        _, events, _ = _stream(toolcall_model, n + 1, wave, chunk=chunk)
        kinds.append([(e.kind, e.frame_index) for e in events if e.kind != "audio"])
    assert kinds[0] == kinds[1] == kinds[2]


def test_session_refusals_change_nothing(toolcall_model):
    s = toolcall_model.create_streaming_session(tools=[TIME_TOOL])
    with pytest.raises(ValueError, match="not a pending tool call"):
        s.submit_tool_result("call_3_0", "{}")
    with pytest.raises(ValueError, match="at most 5"):
        toolcall_model.create_streaming_session(tools=[dict(TIME_TOOL, name=f"t{i}") for i in range(6)])
    with pytest.raises(ValueError, match="come after the last frame"):
        toolcall_model.generate(
            np.zeros(1280 * 4, np.float32), tools=[TIME_TOOL], tool_results=[(50, "call_1_0", "{}")]
        )
    with pytest.raises(ValueError, match="not a pending tool call"):
        toolcall_model.generate(np.zeros(1280 * 4, np.float32), tools=[TIME_TOOL], tool_results=[(1, "call_1_0", "{}")])
    assert s.frame_index == 0 and not s.closed


def test_prompt_with_tools_is_prefilled(toolcall_model):
    s = toolcall_model.create_streaming_session(system_prompt="Be brief.", tools=[TIME_TOOL])
    text = render_system_prompt("Be brief.", [TIME_TOOL])
    assert s.system_prompt == text
    assert s.prompt_positions == len(toolcall_model.tokenizer.encode(text)) + 2
    assert json.loads(text.split("<AVAILABLE_TOOLS>")[1].split("</AVAILABLE_TOOLS>")[0])[0]["name"] == TOOLCALL_TOOL


def test_harness_tool_schedule_row(toolcall_model):
    from harness.families import PASS
    from harness.tool_rows import tool_schedule_rows

    n = _script_len(toolcall_model)
    wave = np.zeros(1280 * (n + 80), np.float32)
    rows = tool_schedule_rows(toolcall_model, wave, [TIME_TOOL], result_after=n + 3, output='{"t": 1}')
    assert [r.status for r in rows] == [PASS] * 5, [(r.metric, r.observed) for r in rows]
    assert "tool_call" in rows[-1].observed and "tool_result_done" in rows[-1].observed
    # A schedule frame the streamed run never reaches with a pending call: nothing is submitted,
    # no response is forced, and the row still compares the two runs (they agree without results).
    rows = tool_schedule_rows(toolcall_model, wave, [TIME_TOOL], result_after=1, output="{}")
    assert rows[-1].status == PASS and "tool_result_done" not in rows[-1].observed
