"""Shared fixtures: tiny synthetic checkpoints written once per test session, the bundled sample audio."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def read_wav16k(name: str) -> np.ndarray:
    import soundfile as sf

    from voicechat.samples import sample_path

    data, sr = sf.read(str(sample_path(name)), dtype="float32")
    assert sr == 16000 and data.ndim == 1, (sr, data.shape)
    return data


@pytest.fixture(scope="session")
def question_wav() -> np.ndarray:
    return read_wav16k("question.wav")


@pytest.fixture(scope="session")
def long_question_wav() -> np.ndarray:
    return read_wav16k("long_question.wav")


def _write(tmp_path_factory, name, **kw):
    from voicechat.synthetic.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp(name), "tiny", **kw)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return _write(tmp_path_factory, "tiny_bf16")


@pytest.fixture(scope="session")
def tiny_ckpt_4bit(tmp_path_factory) -> Path:
    return _write(tmp_path_factory, "tiny_4bit", bits=4)


@pytest.fixture(scope="session")
def tiny_ckpt_8bit(tmp_path_factory) -> Path:
    return _write(tmp_path_factory, "tiny_8bit", bits=8)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    import voicechat

    return voicechat.load(tiny_ckpt)


@pytest.fixture(scope="session")
def tiny_model_4bit(tiny_ckpt_4bit):
    import voicechat

    return voicechat.load(tiny_ckpt_4bit)


TOOLCALL_TOOL = "get_current_time"
TOOLCALL_ARGUMENTS = {"timezone": "UTC"}
TIME_TOOL = {
    "type": "function",
    "name": "get_current_time",
    "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
}


@pytest.fixture(scope="session", params=[4, 8])
def toolcall_model(request, tmp_path_factory):
    """The toolcall preset (voicechat/synthetic/toolcall.py) at 4 and 8 bits: it calls get_current_time."""
    import voicechat
    from voicechat.synthetic.checkpoint import write_checkpoint

    path = write_checkpoint(
        tmp_path_factory.mktemp(f"toolcall_{request.param}bit"),
        "toolcall",
        bits=request.param,
        tool=TOOLCALL_TOOL,
        arguments=TOOLCALL_ARGUMENTS,
    )
    return voicechat.load(path)


from .server_util import make_server, server  # noqa: E402,F401  (server fixtures for the server test modules)
