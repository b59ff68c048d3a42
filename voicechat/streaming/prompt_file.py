"""The prompt-state file: safetensors (the state's arrays) with one JSON metadata text.

The metadata (`voicechat.prompt_state`) is a header, {"format", "format_version", "voicechat",
"checkpoint", "numerics"}, beside the state's `meta_state` (voicechat/streaming/prompt_state.py);
`voicechat.prompt_state.sha256` is a SHA-256 over that text and every array. Both are written and
read by the generic pair `voicechat.io.states.save_state` / `load_state`; this module says what
the header holds and what a reader refuses: another format or format version, another checkpoint
or numerics setting (voicechat/streaming/prompt_identity.py), a truncated or corrupt file.

Version 1 is the only version so far: its arrays are `PromptState.state` (`llm.{i}.conv` /
`.ssm` / `.keys` / `.values`, `tts.{i}.keys` / `.values`, `tts.previous_codes`, `rng.key`,
`prev_text`, `prev_function`, `text_rows.{token}`) and its metadata `PromptState.meta_state` with
the header, exactly as files written before the states described themselves
(parity_tests/test_prompt_state.py reads a file written the old way).
"""

from __future__ import annotations

from pathlib import Path

from voicechat._version import __version__
from voicechat.errors import PromptStateError
from voicechat.io.states import load_state, save_state
from voicechat.streaming.prompt_identity import check_file

FORMAT = "voicechat-prompt-state"
FORMAT_VERSION = 1
META_KEY = "voicechat.prompt_state"
DIGEST_KEY = "voicechat.prompt_state.sha256"
WHAT = "prompt state"


def write(path, arrays: dict, meta_state: dict, *, checkpoint: str, numerics: dict) -> Path:
    """Write a state's `arrays` and `meta_state` with the header (atomically)."""
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "voicechat": __version__,
        "checkpoint": checkpoint,
        "numerics": numerics,
    }
    clash = sorted(set(header) & set(meta_state))
    if clash:
        raise ValueError(f"meta_state keys {clash} are the file header's")
    return save_state(path, arrays, {**header, **meta_state}, meta_key=META_KEY, digest_key=DIGEST_KEY)


def _check_header(path, meta, model) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise PromptStateError(f"{path}: not a voicechat prompt state (format {got!r}; expected {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise PromptStateError(
            f"{path}: prompt state format version {meta.get('format_version')!r}; this "
            f"voicechat reads version {FORMAT_VERSION}. Write it again with "
            "`voicechat cache-prompt`"
        )
    check_file(path, meta, model)


def read(path, model) -> tuple[dict, dict]:
    """(arrays, metadata) of a prompt-state file for `model`: PromptStateError (nothing is used) for
    a missing, truncated or corrupt file, another format version, checkpoint or numerics setting."""
    path = Path(path)
    return load_state(
        path,
        meta_key=META_KEY,
        digest_key=DIGEST_KEY,
        what=WHAT,
        error=PromptStateError,
        check=lambda meta: _check_header(path, meta, model),
    )


__all__ = ["DIGEST_KEY", "FORMAT", "FORMAT_VERSION", "META_KEY", "read", "write"]
