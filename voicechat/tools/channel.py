"""Tool calls over the function channel: the trained prompt, the call parser, the result injection.

The model has a second output channel (the function head) whose tokens are fed
back into the next frame's input with weight `function_channel_weight`. It was
trained to call tools on it while it keeps listening and talking:

    SOTC  <TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>  EOTC      the model's call
    <TOOL_RESPONSE>[result]</TOOL_RESPONSE>                                    forced, one token a frame
    EOTR                                                                       the model's own, when done

The markers are special ids of the LLM tokenizer (SOTC `<SPECIAL_20>` = 20,
EOTC `<SPECIAL_21>` = 21, EOTR `<SPECIAL_22>` = 22). Idle frames carry PAD.
docs/tools.md has the template this renderer follows byte for byte, the frame
timeline of one call and the limits.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from voicechat.events import ToolCall, ToolCallError, ToolResultDone

MARKER_TOKENS = {"sotc": "<SPECIAL_20>", "eotc": "<SPECIAL_21>", "eotr": "<SPECIAL_22>"}
MARKER_IDS = {"sotc": 20, "eotc": 21, "eotr": 22}
MAX_TOOLS = 5
MAX_CALL_TOKENS = 512
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# NVIDIA's serving stack (TensorRT-Model-Connect's function channel, whose test pins it as the
# rendering of NeMo's public Jinja template): base prompt, a blank line, then this block.
TOOLS_HEADER = "You can use the following tools to assist the user if required:\n<AVAILABLE_TOOLS>["
TOOLS_FOOTER = (
    "]</AVAILABLE_TOOLS>\n\n"
    "If you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, '
    '{"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>\n\n'
    "The user will execute tool-calls and return responses from tool(s) in this format:\n"
    '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n\n'
    "Based on the tool responses, you can call additional tools if needed, correct tool calls if any "
    "errors are found, or just respond to the user."
)
CALL_OPEN, CALL_CLOSE = "<TOOLCALL>", "</TOOLCALL>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"
TIMEOUT_RESULT = {"error": "timeout"}


def _ascii_json(value, where: str) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} is not JSON-serialisable ({e})") from None
    if not text.isascii():
        bad = next(c for c in text if not c.isascii())
        raise ValueError(f"{where} contains the non-ASCII character {bad!r}; the tool prompt is ASCII only")
    return text


def normalize_tools(tools) -> tuple[dict, ...]:
    """Validate OpenAI-style function tools -> the definitions the prompt shows (no `type`).

    Accepts the flat form `{"type": "function", "name", "description", "parameters"}` and the
    nested chat-completions form `{"type": "function", "function": {...}}`. At most 5 tools,
    unique names of letters, digits, `_` or `-`, ASCII throughout, `parameters` a JSON-schema
    object. `None` or `[]`: no tools."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, dict)) or not hasattr(tools, "__iter__"):
        raise TypeError(f"tools must be a list of OpenAI-style function tools or None, got {type(tools).__name__}")
    tools = list(tools)
    if len(tools) > MAX_TOOLS:
        raise ValueError(
            f"at most {MAX_TOOLS} tools are supported (the model was trained with up to 5), got {len(tools)}"
        )
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise TypeError(f"{where} must be an object, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        d = tool["function"] if isinstance(tool.get("function"), dict) else tool
        d = {k: v for k, v in d.items() if k != "type"}
        name = d.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.name {name!r} is a duplicate; tool names must be unique")
        seen.add(name)
        if "description" in d and not isinstance(d["description"], str):
            raise ValueError(f"{where}.description must be a string")
        params = d.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ValueError(f'{where}.parameters must be a JSON-schema object ({{"type": "object", ...}})')
        _ascii_json(d, where)
        out.append(json.loads(json.dumps(d)))  # a private deep copy
    return tuple(out)


def render_system_prompt(system_prompt: str | None, tools) -> str:
    """The exact text the session prefills for this prompt and these tools.

    Without tools it is the prompt itself. With tools: the prompt, a blank line (when the prompt is
    not empty), then the trained tools block, each definition as `json.dumps(sort_keys=True)` (`, `
    and `: ` separators), joined by `, ` (docs/tools.md)."""
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise TypeError(f"system_prompt must be a str or None, got {type(system_prompt).__name__}")
    base = system_prompt or ""
    defs = normalize_tools(tools)
    if not defs:
        return base
    if not base.isascii():
        raise ValueError("with tools the system prompt must be ASCII (the trained tool prompt is ASCII only)")
    block = TOOLS_HEADER + ", ".join(json.dumps(d, sort_keys=True) for d in defs) + TOOLS_FOOTER
    return base + "\n\n" + block if base else block


def tool_markers(tokenizer) -> dict[str, int]:
    """The marker ids, checked against the tokenizer; ValueError if it lacks them."""
    vocab = tokenizer.get_vocab()
    missing = [f"{t} (id {MARKER_IDS[k]})" for k, t in MARKER_TOKENS.items() if vocab.get(t) != MARKER_IDS[k]]
    if missing:
        raise ValueError(
            "this checkpoint's tokenizer lacks the function channel's tool markers "
            + ", ".join(missing)
            + "; it cannot take tools"
        )
    return dict(MARKER_IDS)


def result_text(output) -> str:
    """A submitted result -> the text injected: a str exactly as given (what an OpenAI client sends as
    `function_call_output.output` is what the model reads), any other value as `json.dumps(value)`
    (Python's default separators, as in the tools block)."""
    if isinstance(output, str):
        return output
    try:
        return json.dumps(output, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"a tool result must be a str or JSON-serialisable, got {type(output).__name__} ({e})"
        ) from None


def response_text(results: list[str]) -> str:
    """`<TOOL_RESPONSE>[r1, r2]</TOOL_RESPONSE>`: the results of one call list, in call order, joined
    as the template in the tools block shows them."""
    return RESPONSE_OPEN + "[" + ", ".join(results) + "]" + RESPONSE_CLOSE


@dataclass
class _Call:
    call_id: str
    name: str
    result: str | None = None
    answered: bool = False


@dataclass
class FunctionChannel:
    """The function channel's call state machine, fed one token per frame.

    idle -> (SOTC) capturing -> (EOTC) awaiting results -> (all results submitted, or the timeout)
    injecting the response one forced token a frame -> awaiting the model's EOTR -> idle.
    Malformed sequences give a `ToolCallError` and leave the session running. The same object
    drives the streaming session and the offline run, so both give the same frames."""

    tokenizer: object
    tools: tuple[dict, ...]
    pad_id: int
    timeout_frames: int | None = None
    state: str = "idle"
    tokens: list[int] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    call_frame: int = -1
    forced: list[int] = field(default_factory=list)
    answered_ids: set = field(default_factory=set)

    def __post_init__(self):
        m = tool_markers(self.tokenizer)
        self.sotc, self.eotc, self.eotr = m["sotc"], m["eotc"], m["eotr"]
        self.names = {t["name"] for t in self.tools}

    def copy(self) -> FunctionChannel:
        other = FunctionChannel.__new__(FunctionChannel)
        other.__dict__.update(self.__dict__)
        other.tokens, other.forced = list(self.tokens), list(self.forced)
        other.calls = [_Call(c.call_id, c.name, c.result, c.answered) for c in self.calls]
        other.answered_ids = set(self.answered_ids)
        return other

    @property
    def pending_call_ids(self) -> list[str]:
        return [c.call_id for c in self.calls if not c.answered] if self.state == "awaiting_results" else []

    # -- results

    def submit(self, call_id: str, output) -> None:
        """Record a call's result; the response is forced from the next computed frame once every call
        of the list has one. ValueError (nothing changed) for an unknown or answered call id."""
        if not isinstance(call_id, str):
            raise TypeError(f"call_id must be a str, got {type(call_id).__name__}")
        value = result_text(output)
        call = next((c for c in self.calls if c.call_id == call_id), None) if self.state == "awaiting_results" else None
        if call is None or call.answered:
            why = (
                "was already answered"
                if call_id in self.answered_ids or (call and call.answered)
                else "is not a pending tool call"
            )
            pending = ", ".join(self.pending_call_ids) or "none"
            raise ValueError(f"call_id {call_id!r} {why}; pending calls: {pending}")
        call.result, call.answered = value, True
        self.answered_ids.add(call_id)
        if all(c.answered for c in self.calls):
            self._start_injection()

    def _start_injection(self) -> None:
        ids = self.tokenizer.encode(response_text([c.result for c in self.calls]))
        self.forced = list(ids)
        self.state = "injecting"

    def forced_token(self, frame_index: int) -> int | None:
        """The function token to force at this frame (None: the model's own). Call once per frame,
        before it is computed; applies the timeout (counted in frames, so offline equals streamed)."""
        if (
            self.state == "awaiting_results"
            and self.timeout_frames is not None
            and frame_index - self.call_frame > self.timeout_frames
        ):
            for c in self.calls:
                if not c.answered:
                    c.result, c.answered = result_text(TIMEOUT_RESULT), True
                    self.answered_ids.add(c.call_id)
            self._start_injection()
        if self.state != "injecting":
            return None
        token = self.forced.pop(0)
        if not self.forced:
            self.state = "awaiting_eotr"
        return token

    # -- the model's tokens

    def observe(self, frame_index: int, token_id: int, forced: bool) -> list:
        """Feed this frame's function token; -> ToolCall / ToolCallError / ToolResultDone events."""
        if forced or token_id == self.pad_id:
            return []  # forced response tokens do not move the markers; PAD is idle (dropped in a call)
        s = self.state
        if s == "capturing":
            if token_id == self.eotc:
                return self._parse(frame_index)
            if token_id in (self.sotc, self.eotr):
                what = "a nested SOTC" if token_id == self.sotc else "EOTR before EOTC"
                return self._error(frame_index, f"{what} inside a tool call", reset=True)
            self.tokens.append(int(token_id))
            if len(self.tokens) > MAX_CALL_TOKENS:
                return self._error(frame_index, f"a tool call longer than {MAX_CALL_TOKENS} tokens", reset=True)
            return []
        if token_id == self.sotc:
            if s == "idle":
                self.state, self.tokens = "capturing", []
                return []
            return self._error(frame_index, "SOTC while an earlier call's response is not finished (no EOTR yet)")
        if token_id == self.eotc:
            return self._error(frame_index, "EOTC without SOTC")
        if token_id == self.eotr:
            if s == "awaiting_eotr":
                done = [ToolResultDone(frame_index, c.call_id) for c in self.calls]
                self.state, self.calls = "idle", []
                return done
            what = "before the tool result was fed" if s == "awaiting_results" else "without a tool call"
            return self._error(frame_index, f"EOTR {what}")
        return []

    def _error(self, frame_index: int, message: str, *, reset: bool = False) -> list:
        raw = self.tokenizer.decode(self.tokens) if self.tokens else ""
        if reset:
            self.state, self.tokens = "idle", []
        return [ToolCallError(frame_index, message, raw)]

    def _parse(self, frame_index: int) -> list:
        raw = self.tokenizer.decode(self.tokens)
        self.state, self.tokens = "idle", []
        body = raw.strip()
        if body.startswith(CALL_OPEN) and body.endswith(CALL_CLOSE):
            body = body[len(CALL_OPEN) : -len(CALL_CLOSE)].strip()
        try:
            parsed = json.loads(body, parse_constant=_refuse_constant)
        except (json.JSONDecodeError, ValueError, RecursionError) as e:
            return [ToolCallError(frame_index, f"the tool call is not valid JSON ({e})", raw)]
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for pos, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return [ToolCallError(frame_index, f"call {pos} is not an object with a string 'name'", raw)]
            if item["name"] not in self.names:
                known = ", ".join(sorted(self.names))
                return [
                    ToolCallError(
                        frame_index, f"call {pos} names the unknown tool {item['name']!r} (declared: {known})", raw
                    )
                ]
            args = item.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    return [ToolCallError(frame_index, f"call {pos}: 'arguments' is a string but not JSON ({e})", raw)]
            if not isinstance(args, dict):
                return [ToolCallError(frame_index, f"call {pos}: 'arguments' must be a JSON object", raw)]
            calls.append((item["name"], args))
        if not calls:
            return [ToolCallError(frame_index, "the tool call list is empty", raw)]
        self.calls = [_Call(f"call_{frame_index}_{pos}", name) for pos, (name, _) in enumerate(calls)]
        self.call_frame = frame_index
        self.state = "awaiting_results"
        return [
            ToolCall(frame_index, c.call_id, name, args, raw) for c, (name, args) in zip(self.calls, calls, strict=True)
        ]


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def timeout_frames(seconds, frame_duration: float) -> int | None:
    """`tool_timeout_seconds` -> whole frames of the session's clock (None: wait for ever)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"tool_timeout_seconds must be a positive finite number or None, got {seconds!r}")
    return max(1, math.ceil(seconds / frame_duration - 1e-9))
