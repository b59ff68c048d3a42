"""The three-way parity matrix (this project, mlx-vlm, mlx-audio) on the tiny 4-bit checkpoint (`-m peers`).

`harness.engine.run_matrix` / `voicechat parity --against mlx-vlm --against mlx-audio`: every pair in
one report, each pair's first difference, the odd one out. On the 4-bit checkpoint the report must pin
mlx-audio's codes (odd one out, documented only after the re-run with its departures undone matched),
never the language path; with that verification disabled the same rows fail and the exit status is 1.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("mlx_audio")
pytestmark = pytest.mark.peers
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from harness import engine  # noqa: E402
from harness.backends import get_backend  # noqa: E402
from harness.families import DOCUMENTED, FAIL, NEMOTRON  # noqa: E402

FRAME = 1280
NAMES = ("voicechat", "mlx-vlm", "mlx-audio")


@pytest.fixture(scope="module")
def backends(tiny_ckpt_4bit):
    out = []
    for n in NAMES:
        b = get_backend(n)
        b.load(str(tiny_ckpt_4bit))
        out.append(b)
    yield out
    for b in out:
        b.close()


@pytest.fixture(scope="module")
def clip(question_wav):
    return question_wav[: 12 * FRAME].copy()


@pytest.fixture(scope="module")
def report(backends, clip):
    return engine.run_matrix(backends, clip, components=False)


def test_every_pair_agrees_and_mlx_audio_codes_are_the_odd_one_out(report):
    m = report.matrix
    assert list(m["pairs"]) == ["voicechat vs mlx-vlm", "voicechat vs mlx-audio", "mlx-vlm vs mlx-audio"]
    assert report.ok and all(p["ok"] for p in m["pairs"].values())
    first = m["pairs"]["mlx-vlm vs mlx-audio"]["first_documented"]
    assert (first["field"], first["frame"], first["difference_id"]) == (
        "codes per frame",
        1,
        "mlx_audio_tts_departures",
    )
    odd = {(o["path"], o["field"]): o for o in m["odd_one_out"]}
    for path in ("offline", "streamed"):
        for field in ("codes per frame", "decoded codes per frame"):
            assert odd[(path, field)]["odd_one_out"] == "mlx-audio" and odd[(path, field)]["documented"]
    # the language path is nobody's odd one out: ids and logits agree in every pair
    assert not [o for o in m["odd_one_out"] if o["family"] == NEMOTRON or "ids" in o["field"]]
    assert all(
        r.status != DOCUMENTED or r.difference_id != "mlx_audio_tts_departures" or "codes" in r.metric
        for r in report.rows
    )
    md = report.to_markdown()
    assert "Odd one out" in md and "**mlx-audio**" in md and "mlx-vlm vs mlx-audio" in md


def test_without_the_verification_the_codes_fail(backends, clip, monkeypatch):
    """The documented rows rest on the re-run: with `departures_undone` made a no-op, the codes of every
    pair with mlx-audio fail and the matrix is not ok."""
    from contextlib import nullcontext

    from harness.backends import mlx_audio_backend

    monkeypatch.setattr(mlx_audio_backend, "departures_undone", lambda backend, names=None: nullcontext())
    rep = engine.run_matrix(backends[1:], clip, components=False)
    assert not rep.ok
    failing = {(r.comparison, r.metric) for r in rep.rows if r.status == FAIL}
    assert ("offline: mlx-vlm vs mlx-audio", "codes per frame") in failing
    assert ("streamed: mlx-vlm vs mlx-audio", "codes per frame") in failing
    p = rep.matrix["pairs"]["mlx-vlm vs mlx-audio"]
    assert not p["ok"] and p["first_failure"]["frame"] == 1
