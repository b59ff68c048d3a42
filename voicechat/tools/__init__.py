"""Tool calls on the model's function channel (channel.py: the trained prompt, the call parser,
the result injection) and the runners that execute them (runners.py: Python callables, MCP)."""

from voicechat.tools.channel import (
    MARKER_IDS,
    MAX_TOOLS,
    FunctionChannel,
    normalize_tools,
    render_system_prompt,
    timeout_frames,
    tool_markers,
)

__all__ = [
    "MARKER_IDS",
    "MAX_TOOLS",
    "FunctionChannel",
    "normalize_tools",
    "render_system_prompt",
    "timeout_frames",
    "tool_markers",
]
