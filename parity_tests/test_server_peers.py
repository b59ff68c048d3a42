"""`voicechat serve` against the reference's server (`mlx_vlm.server`, -m peers).

Both servers run as subprocesses on 127.0.0.1 on the same synthetic tiny checkpoint and are
driven by the same client (voicechat.server.client) with the same audio, seed and prompt.
The event kinds and their order agree (our `response.audio.tail` aside: the codec tail mlx-vlm
drops), and so do the text / function ids, the transcript and the audio_codes (both send the
codes the codec decodes, after control-code replacement). Figures go to
reports/server/vs_mlx_vlm_server.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm", reason="needs the `peers` extra")
from voicechat.server.client import run_stream_audio, to_pcm16
from voicechat.server.compare import ServerPair, compare_streams

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def servers(tiny_ckpt, tmp_path_factory):
    with ServerPair(str(tiny_ckpt), tmp_path_factory.mktemp("server_logs")) as pair:
        yield pair.ours_url, pair.reference_url


@pytest.mark.peers
@pytest.mark.parametrize("prompt", [None, "You are a helpful assistant."])
def test_same_client_same_events_as_mlx_vlm_server(servers, tiny_ckpt, question_wav, prompt):
    ours_url, vlm_url = servers
    pcm = to_pcm16(question_wav)
    kw = dict(fast=True, chunk_samples=1280, seed=0, system_prompt=prompt, model=str(tiny_ckpt))
    ours = run_stream_audio(ours_url, pcm, **kw)
    ref = run_stream_audio(vlm_url, pcm, **kw)
    assert ours.end == ref.end == "response.done" and not ours.errors and not ref.errors
    c = compare_streams(ours.events, ref.events)  # audio_codes exactly as each server sends them
    out = REPO / "reports" / "server"
    out.mkdir(parents=True, exist_ok=True)
    name = "vs_mlx_vlm_server" + ("_prompt" if prompt else "") + ".json"
    (out / name).write_text(
        json.dumps(
            {"prompt": prompt, "close_code_ours": ours.close_code, "close_code_reference": ref.close_code, **c},
            indent=1,
        )
        + "\n"
    )
    assert c["ours_only"] == ["response.audio.tail"]
    assert c["kinds_equal"], c  # session.created .. session.updated, per-frame events, committed, done
    assert c["frames_ours"] == c["frames_reference"] == -(-pcm.size // 1280)
    assert c["text_ids_equal"] and c["function_ids_equal"] and c["transcript_equal"], c
    assert c["codes_equal"], c
    assert ours.close_code == 1000  # mlx-vlm's server ends without a close frame (1006)


@pytest.mark.peers
def test_parity_row_against_mlx_vlm_server(tiny_ckpt, tmp_path):
    from voicechat.cli.main import main
    from voicechat.samples import sample_path

    rc = main(
        [
            "parity",
            "-m",
            str(tiny_ckpt),
            "--audio",
            str(sample_path("question")),
            "--against",
            "mlx-vlm-server",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    rows = {r["metric"]: r["status"] for r in report["rows"] if r["family"] == "server"}
    assert rc == 0 and rows == dict.fromkeys(
        ("event kinds and order", "frames", "text ids", "function ids", "transcript deltas", "audio_codes"), "pass"
    ), report["rows"]
