"""The benchmark runner (bench/): run folder contents, failure reporting, docs determinism, floor model.

The runner runs on the tiny 4-bit synthetic checkpoint with a 0.96 s input,
1 warm-up and 2 measured runs, against this project's backend and a backend
that raises in the middle of its second measured stream. Statistics in
summary.csv are checked against an independent recomputation from frames.csv
(numpy instead of pandas), so a wrong aggregation fails. The micro-benchmarks at
the end time the per-frame stage functions with pytest-benchmark (no assertions
on time; CI runs them once with --benchmark-disable).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pandas as pd
import pytest

from bench import BenchOptions, Progress, run_bench
from bench.docs import BEGIN, END, update_docs
from bench.floor import FORMATS, frame_weight_bytes, measure_bandwidth
from bench.report import FLOOR_COLUMNS, FRAME_COLUMNS, RUN_COLUMNS, SUMMARY_COLUMNS, render_markdown
from harness.backends.voicechat_backend import VoiceChatBackend
from voicechat.runtime import ExecutionPolicy

from .runtime_util import default_policy

FRAME = 1280
INPUT_FRAMES = 12
EXTRA_S = 0.24  # 3840 samples of silence: 3 more frames
STREAM_FRAMES = INPUT_FRAMES + 3
RUNS, WARMUP, DROP = 2, 1, 2
STAGES = ("perception", "rnnt", "language", "tts", "codec", "total")
# Statistics recomputed from frames.csv: the CSV round trip keeps 17 significant
# digits, so only summation-order rounding (~1e-12 ms) can differ.
STAT_TOL = 1e-9


class FlakyBackend(VoiceChatBackend):
    """This project's backend, except that its 3rd stream (measured run 2) raises halfway through."""

    name = "flaky"

    def __init__(self, counter: dict):
        super().__init__()
        self.counter = counter

    def stream(self, audio, **kw):
        self.counter["streams"] += 1
        if self.counter["streams"] == 3:
            super().stream(audio[: len(audio) // 2], **kw)
            raise RuntimeError("injected failure halfway through the stream")
        return super().stream(audio, **kw)


@pytest.fixture(scope="module")
def wav_path(tmp_path_factory, question_wav):
    import soundfile as sf

    path = tmp_path_factory.mktemp("bench_in") / "clip.wav"
    sf.write(str(path), question_wav[: INPUT_FRAMES * FRAME], 16000, subtype="FLOAT")
    return path


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, tiny_ckpt_4bit, wav_path):
    counter = {"streams": 0}

    def factory(name):
        return FlakyBackend(counter) if name == "flaky" else VoiceChatBackend()

    out = tmp_path_factory.mktemp("bench_out") / "run"
    log = io.StringIO()
    opts = BenchOptions(
        checkpoints=[str(tiny_ckpt_4bit)],
        audio=[str(wav_path)],
        out=out,
        backends=["voicechat", "flaky"],
        runs=RUNS,
        warmup=WARMUP,
        drop_first=DROP,
        extra_decoding_seconds=EXTRA_S,
        bandwidth_mb=4.0,
        heartbeat_s=0,
    )
    result = run_bench(opts, backend_factory=factory, progress=Progress(stream=log))
    return {"out": out, "result": result, "log": log.getvalue(), "ckpt": tiny_ckpt_4bit}


def test_every_output_file_is_written(bench_run):
    out = bench_run["out"]
    for name in (
        "frames.csv",
        "runs.csv",
        "summary.csv",
        "summary.md",
        "floor.csv",
        "env.json",
        "frame_times.png",
        "stage_p50.png",
        "frame_cdf.png",
        "floor.png",
    ):
        p = out / name
        assert p.is_file() and p.stat().st_size > 0, name
        if name.endswith(".png"):
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
            assert p.stat().st_size > 10_000, f"{name} looks empty"


def test_frames_csv_has_one_row_per_frame_per_measured_run(bench_run):
    frames = pd.read_csv(bench_run["out"] / "frames.csv")
    assert list(frames.columns) == FRAME_COLUMNS
    ok = frames[frames.backend == "voicechat"]
    # voicechat: 2 measured runs; flaky: run 1 only (run 2 failed, its frames are not statistics)
    assert len(ok) == RUNS * STREAM_FRAMES
    assert len(frames[frames.backend == "flaky"]) == STREAM_FRAMES
    for run, f in ok.groupby("run"):
        assert list(f.frame_index) == list(range(STREAM_FRAMES)), run
        assert list(f.dropped) == [i < DROP for i in range(STREAM_FRAMES)]
        stage_sum = f[[f"{s}_ms" for s in STAGES[:-1]]].sum(axis=1)
        assert (stage_sum <= f.total_ms + 1e-6).all()  # stages are disjoint parts of the frame
        assert (f[[f"{s}_ms" for s in STAGES]] >= 0).all().all()


def test_runs_csv_records_every_run_and_the_failure(bench_run):
    runs = pd.read_csv(bench_run["out"] / "runs.csv", keep_default_na=False, na_values=[""])
    assert list(runs.columns) == RUN_COLUMNS
    assert len(runs) == (WARMUP + RUNS) * 2
    # interleaved: within each run the backends take turns in the given order
    assert list(zip(runs.phase, runs.run, runs.backend, strict=True)) == [
        ("warmup", 1, "voicechat"),
        ("warmup", 1, "flaky"),
        ("measured", 1, "voicechat"),
        ("measured", 1, "flaky"),
        ("measured", 2, "voicechat"),
        ("measured", 2, "flaky"),
    ]
    failed = runs[runs.status != "ok"]
    assert len(failed) == 1
    row = failed.iloc[0]
    assert (row.backend, row.phase, row.run) == ("flaky", "measured", 2)
    assert "streaming" in row.error and "RuntimeError" in row.error and "injected failure" in row.error
    good = runs[runs.status == "ok"]
    assert (good.frames == STREAM_FRAMES).all()
    assert (good.offline_frames > 0).all() and (good.offline_wall_s > 0).all()
    assert (good.load_s > 0).all() and (good.create_s >= 0).all() and (good.mlx_peak_mb > 0).all()
    assert (good.rss_peak_mb > 0).all()
    assert bench_run["result"].failed == 1 and not bench_run["result"].ok
    log = bench_run["log"]
    assert "FAILED" in log and "injected failure" in log and "measured 2/2" in log


def test_summary_matches_an_independent_recomputation(bench_run):
    out = bench_run["out"]
    summary = pd.read_csv(out / "summary.csv", keep_default_na=False, na_values=[""])
    assert list(summary.columns) == SUMMARY_COLUMNS
    assert list(summary.backend) == ["voicechat", "flaky"]
    frames = pd.read_csv(out / "frames.csv")
    for _, s in summary.iterrows():
        kept = frames[(frames.backend == s.backend) & ~frames.dropped]
        assert s.frames == len(kept)
        for st in STAGES:
            v = kept[f"{st}_ms"].to_numpy(float)
            assert math.isclose(s[f"{st}_mean_ms"], float(np.mean(v)), rel_tol=STAT_TOL)
            assert math.isclose(s[f"{st}_p50_ms"], float(np.percentile(v, 50)), rel_tol=STAT_TOL)
            assert math.isclose(s[f"{st}_p95_ms"], float(np.percentile(v, 95)), rel_tol=STAT_TOL)
            assert math.isclose(s[f"{st}_max_ms"], float(np.max(v)), rel_tol=STAT_TOL)
        assert math.isclose(s.rtf, np.mean(kept.total_ms) / 80.0, rel_tol=STAT_TOL)
        assert math.isclose(s.frames_per_second, 1000.0 / np.mean(kept.total_ms), rel_tol=STAT_TOL)
    vc, fl = summary.iloc[0], summary.iloc[1]
    assert (vc.status, vc.runs_ok, vc.runs_failed) == ("ok", 2, 0)
    assert (fl.status, fl.runs_ok, fl.runs_failed) == ("partial", 1, 1)
    assert "injected failure" in fl.errors and not isinstance(vc.errors, str)
    assert vc.baseline == fl.baseline == "voicechat"
    assert vc.rtf_vs_baseline == 1.0
    assert math.isclose(fl.total_p50_vs_baseline, fl.total_p50_ms / vc.total_p50_ms, rel_tol=STAT_TOL)
    md = (out / "summary.md").read_text()
    assert "## Failures" in md and "injected failure" in md
    assert "| flaky | partial |" in md
    assert "## Backend ratios" in md and "flaky / voicechat" in md


def test_floor_csv_and_env_json(bench_run):
    out = bench_run["out"]
    floor = pd.read_csv(out / "floor.csv")
    assert list(floor.columns) == FLOOR_COLUMNS
    assert len(floor) == 2 * len(STAGES)  # per backend x stage (5 stages + total)
    assert (floor.floor_ms > 0).all()
    for _be, f in floor.groupby("backend"):
        f = f.set_index("stage")
        parts = f.loc[list(STAGES[:-1])]
        assert math.isclose(f.loc["total", "floor_ms"], parts.floor_ms.sum(), rel_tol=1e-9)
        assert math.isclose(f.loc["total", "weight_mb"], parts.weight_mb.sum(), rel_tol=1e-9)
        np.testing.assert_allclose(f.p50_over_floor, f.measured_p50_ms / f.floor_ms, rtol=1e-9)
    env = json.loads((out / "env.json").read_text())
    for key in (
        "date",
        "machine",
        "os",
        "python",
        "mlx",
        "packages",
        "git_revision",
        "checkpoints",
        "method",
        "bandwidth",
    ):
        assert key in env, key
    assert env["machine"]["cpu_count"] >= 1 and env["mlx"]["version"] == mx.__version__
    # the `voicechat` backend's execution policy, as `voicechat.load` chooses it in this process
    assert env["mlx"]["voicechat_policy"] == ExecutionPolicy.for_device().as_dict()
    assert not {
        "voicechat_cpu_streams",
        "voicechat_compile",
        "voicechat_cpu_qmv",
        "voicechat_host_gemm",
        "voicechat_overlap",
    } & set(env["mlx"])  # the process-wide switches are gone
    assert env["packages"]["mlx"] and env["packages"]["numpy"] == np.__version__
    ck = env["checkpoints"][0]
    cfg = bench_run["ckpt"] / "config.json"
    assert ck["config_sha256"] == hashlib.sha256(cfg.read_bytes()).hexdigest()
    assert ck["index_sha256"] and ck["synthetic"] is False  # given as a folder, not as synthetic:...
    m = env["method"]
    assert (m["runs"], m["warmup"], m["drop_first"], m["extra_decoding_seconds"]) == (RUNS, WARMUP, DROP, EXTRA_S)
    assert m["inputs"][0]["streamed_frames"] == STREAM_FRAMES
    assert set(env["bandwidth"]) == set(FORMATS) and all(v["gbps"] > 0 for v in env["bandwidth"].values())


def test_docs_generation_is_deterministic(bench_run, tmp_path):
    run_dir = bench_run["out"]
    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()
    page.write_text(f"# Performance\n\nhand-written intro\n\n{BEGIN}\nstale\n{END}\n\nhand-written outro\n")
    assert update_docs(run_dir, page)
    first = page.read_bytes()
    assert not update_docs(run_dir, page)  # same folder: nothing to change
    assert page.read_bytes() == first
    text = first.decode()
    assert text.startswith("# Performance\n\nhand-written intro\n\n" + BEGIN)
    assert text.endswith(END + "\n\nhand-written outro\n") and "stale" not in text
    # Same folder into another page at the same relative place: byte-identical.
    other = tmp_path / "copy" / "docs" / "performance.md"
    other.parent.mkdir(parents=True)
    other.write_text(f"# Performance\n\nhand-written intro\n\n{BEGIN}\n{END}\n\nhand-written outro\n")
    (tmp_path / "copy" / "run").symlink_to(run_dir, target_is_directory=True)
    (tmp_path / "run").symlink_to(run_dir, target_is_directory=True)
    update_docs(tmp_path / "copy" / "run", other)
    update_docs(tmp_path / "run", page)
    assert other.read_bytes() == page.read_bytes()
    # What the section says: machine, checkpoint, method, date; links to the plots next to the data.
    env = json.loads((run_dir / "env.json").read_text())
    assert env["machine"]["cpu"] in text and env["date"] in text
    assert "**Execution policy** of the `voicechat` backend" in text
    assert "2 measured run(s)" in text and "first 2 frames" in text and "0.24 s of silence" in text
    assert "](../run/frame_times.png)" in page.read_text()
    assert render_markdown(run_dir) == render_markdown(run_dir)


def test_docs_page_without_markers_is_refused(bench_run, tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\nno markers here\n")
    with pytest.raises(ValueError, match="no generated section"):
        update_docs(bench_run["out"], page)
    assert page.read_text() == "# Performance\n\nno markers here\n"


def test_cli_exit_status_and_errors(monkeypatch, tiny_ckpt_4bit, wav_path, tmp_path, capsys):
    import bench.runner
    from voicechat.cli.main import main

    counter = {"streams": 0}
    monkeypatch.setattr(bench.runner, "_default_factory", lambda name: FlakyBackend(counter))
    out = tmp_path / "cli_run"
    argv = [
        "bench",
        "-m",
        str(tiny_ckpt_4bit),
        "--audio",
        str(wav_path),
        "--runs",
        "2",
        "--warmup",
        "0",
        "--drop-first",
        "0",
        "--extra-decoding-seconds",
        "0",
        "--no-floor",
        "--no-plots",
        "--no-offline",
        "--quiet",
        "--out",
        str(out),
    ]
    counter["streams"] = 1  # the 2nd stream of this run is the flaky backend's 3rd call: it fails
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "1 run(s) failed" in captured.err and "## Failures" in captured.out
    assert pd.read_csv(out / "summary.csv").status.tolist() == ["partial"]
    assert main(["bench"]) == 2  # nothing to do
    assert main(["bench", "--update-docs", str(tmp_path / "missing")]) == 2
    assert main(["bench", "-m", str(tiny_ckpt_4bit), "--audio", str(wav_path), "--runs", "0"]) == 2
    assert (
        main(
            [
                "bench",
                "-m",
                str(tiny_ckpt_4bit),
                "--audio",
                str(tmp_path / "nope.wav"),
                "--quiet",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )


# -- floor model


def test_frame_weight_bytes_by_an_independent_count(tiny_model_4bit, tiny_ckpt_8bit):
    from mlx.utils import tree_flatten

    import voicechat

    params = dict(tree_flatten(tiny_model_4bit.parameters()))
    b = frame_weight_bytes(tiny_model_4bit)

    def total(prefixes):
        return sum(v.nbytes for k, v in params.items() if k.startswith(prefixes))

    # language: every LLM tensor, both heads, 3 of the V embedding rows (weights + scales + biases)
    v = tiny_model_4bit.config.text_config.vocab_size
    expect = (
        total(("stt_model.llm.", "stt_model.lm_head.", "stt_model.function_head."))
        + total("stt_model.embed_tokens.") * 3 / v
    )
    assert math.isclose(b["language"].weight_bytes, expect, rel_tol=1e-12)
    assert b["language"].by_format["q4"] > 0 and b["language"].by_format["q8"] == 0
    assert b["language"].state_bytes > 0
    # perception: all of it, once
    assert math.isclose(b["perception"].weight_bytes, total("stt_model.perception."), rel_tol=1e-12)
    # codec: the decoder plus one row of each codebook; the encoder is not used per frame
    mus = [k for k in params if k.startswith("tts_model.audio_codec.prvq.mus_list.")]
    expect = total("tts_model.audio_codec.decoder.") + sum(params[k].nbytes / params[k].shape[0] for k in mus)
    assert math.isclose(b["codec"].weight_bytes, expect, rel_tol=1e-12)
    # tts: more than the backbone (MoG passes), less than 5x everything
    tts_all = total("tts_model.tts_model.")
    assert total("tts_model.tts_model.backbone.") < b["tts"].weight_bytes < 5 * tts_all
    # 8-bit reads more language bytes than 4-bit, the rest is identical
    b8 = frame_weight_bytes(voicechat.load(tiny_ckpt_8bit))
    assert b8["language"].by_format["q8"] > b["language"].by_format["q4"]
    for s in ("perception", "rnnt", "tts", "codec"):
        assert math.isclose(b8[s].weight_bytes, b[s].weight_bytes, rel_tol=1e-12)


def test_measure_bandwidth_rejects_bad_sizes():
    with pytest.raises(ValueError, match="target_mb"):
        measure_bandwidth(0)
    r = measure_bandwidth(2.0, reps=2)
    assert set(r) == set(FORMATS)
    for fmt, v in r.items():
        assert v["gbps"] > 0 and v["matrix_mb"] >= 1.9, fmt


# -- micro-benchmarks of the per-frame stage functions (timings are not asserted)


@pytest.fixture
def warm_session(tiny_model_4bit, question_wav):
    """A streaming session after two frames, so every stage is past its position-0 special case."""
    s = tiny_model_4bit.create_streaming_session()
    s.push_audio(question_wav[: 2 * FRAME])
    return s


def test_bench_perception_frame(benchmark, warm_session, question_wav):
    frame = question_wav[2 * FRAME : 3 * FRAME]

    def run():
        enc, emb = warm_session.perception.push_frame(frame)
        mx.eval(enc, emb)
        return enc, emb

    enc, emb = benchmark(run)
    cfg = warm_session.config
    assert enc.shape == (cfg.audio_config.encoder.d_model,) and emb.shape == (cfg.text_config.hidden_size,)


def test_bench_rnnt_step(benchmark, warm_session, question_wav):
    enc, _ = warm_session.perception.push_frame(question_wav[2 * FRAME : 3 * FRAME])
    mx.eval(enc)
    tokens = benchmark(lambda: warm_session.rnnt.step(enc))
    assert isinstance(tokens, list)


def test_bench_language_step(benchmark, warm_session, question_wav):
    _, emb = warm_session.perception.push_frame(question_wav[2 * FRAME : 3 * FRAME])
    mx.eval(emb)

    def run():
        out = warm_session.timeline.language_step(emb)
        mx.eval(out[0], out[1])
        return out

    text_id, function_id, _, _ = benchmark(run)
    assert text_id.dtype == mx.int32 and function_id.dtype == mx.int32


def test_bench_tts_step(benchmark, warm_session):
    text_id = mx.array(warm_session.text_ids[-1], dtype=mx.int32)
    function_id = mx.array(warm_session.function_ids[-1], dtype=mx.int32)

    def run():
        codes = warm_session.timeline.tts_step(text_id, function_id)
        mx.eval(codes)
        return codes

    codes = benchmark(run)
    assert codes.shape == (warm_session.config.tts_config.num_quantizers,)


def test_bench_codec_decode_step(benchmark, warm_session):
    codec, state = warm_session.codec, warm_session.codec_state
    codes = mx.zeros((warm_session.config.tts_config.num_quantizers,), dtype=mx.int32)

    def run():
        audio = codec.decode_step(codes, state)
        mx.eval(audio, state.arrays())
        return audio

    audio = benchmark(run)
    assert audio.shape == (codec.samples_per_frame,)


def test_bench_whole_frame(benchmark, warm_session, question_wav):
    frame = question_wav[2 * FRAME : 3 * FRAME]
    events = benchmark(lambda: warm_session.push_audio(frame))
    audio = [e for e in events if e.kind == "audio"]
    assert len(audio) == 1 and audio[0].samples.shape == (warm_session.codec.samples_per_frame,)


def test_isolated_runs_and_frame_limit(tiny_ckpt_4bit, wav_path, tmp_path):
    """--isolate runs each load + stream (and the floor model) in a spawned process; --frames
    streams only the first N frames. The records come back whole."""
    out = tmp_path / "iso"
    opts = BenchOptions(
        checkpoints=[str(tiny_ckpt_4bit)],
        audio=[str(wav_path)],
        out=out,
        backends=["voicechat"],
        runs=1,
        warmup=0,
        drop_first=1,
        extra_decoding_seconds=EXTRA_S,
        bandwidth_mb=4.0,
        heartbeat_s=0,
        offline=False,
        plots=False,
        frames=4,
        isolate=True,
    )
    result = run_bench(opts, progress=Progress(stream=io.StringIO()))
    assert result.failed == 0
    frames = pd.read_csv(out / "frames.csv")
    assert len(frames) == 4 and list(frames.frame_index) == [0, 1, 2, 3]
    runs = pd.read_csv(out / "runs.csv")
    assert (runs.status == "ok").all() and runs.load_s.iloc[0] > 0 and runs.rss_peak_mb.iloc[0] > 0
    floor = pd.read_csv(out / "floor.csv").set_index("stage")
    assert (floor.resident_mb > 0).all()
    with pytest.raises(ValueError, match="frames must be at least 1"):
        BenchOptions(checkpoints=["x"], audio=["y"], out=out, frames=0).validate()


def test_resident_bytes_follow_the_float32_copies(tiny_ckpt, monkeypatch):
    """Resident MB per stage: with float32 copies (`VOICECHAT_FLOAT32_COPIES=1`) each layer
    whose W.T is float32 there but 16-bit without them costs 2 more bytes per weight element
    than without (one copy, not two), and 2 per bias element its copy widened; counted from the
    layers' shapes and dtypes, not from what `resident_bytes` counts."""
    import voicechat
    from bench.floor import _stage_of, resident_bytes_by_stage

    resident, layers = {}, {}
    for copies in ("0", "1"):
        monkeypatch.setenv("VOICECHAT_FLOAT32_COPIES", copies)
        model = voicechat.load(tiny_ckpt, warmup=False)
        resident[copies] = resident_bytes_by_stage(model)
        layers[copies] = {
            path: (
                m.weight.size,
                m.weight.dtype,
                m.bias.size if "bias" in m else 0,
                m.bias.dtype if "bias" in m else None,
            )
            for path, m in model.named_modules()
            if "weight" in m and isinstance(m.weight, mx.array) and "_weight_view" in m.__dict__
        }
        del model
    grown = {}
    for path, (n, dtype, nb, bias_dtype) in layers["1"].items():
        _n0, dtype0, _, bias_dtype0 = layers["0"].get(path, (n, None, nb, None))
        if dtype != mx.float32:
            continue
        extra = 0
        if dtype0 != mx.float32:  # 16-bit W.T or the stored weight without the copies
            extra += 2 * n
        if nb and bias_dtype == mx.float32 and bias_dtype0 != mx.float32:
            extra += 2 * nb
        stage = _stage_of(path + ".")
        grown[stage] = grown.get(stage, 0) + extra
    assert grown.get("language", 0) == 0 and grown["perception"] > 0 and grown["tts"] > 0
    for stage in ("perception", "rnnt", "language", "tts", "codec"):
        assert resident["1"][stage] - resident["0"][stage] == grown.get(stage, 0), stage
    for r in resident.values():
        assert r["total"] == sum(v for k, v in r.items() if k != "total")


def test_named_docs_section_is_appended_then_replaced(bench_run, tmp_path):
    """`--section full` keeps the default section as it is and writes its own block, appended
    the first time and replaced in place afterwards."""
    from bench.docs import markers

    page = tmp_path / "performance.md"
    page.write_text(f"# Performance\n\n{BEGIN}\nsmall run\n{END}\n\nhand-written outro\n")
    begin, end = markers("full")
    assert update_docs(bench_run["out"], page, "full")
    text = page.read_text()
    assert text.startswith(f"# Performance\n\n{BEGIN}\nsmall run\n{END}\n\nhand-written outro\n\n{begin}")
    assert text.rstrip().endswith(end) and "Full published shapes (synthetic weights on a CPU)" in text
    assert "--section full" in text
    assert not update_docs(bench_run["out"], page, "full")
    with pytest.raises(ValueError, match="section name must be a word"):
        update_docs(bench_run["out"], page, "a b")


# -- dispatch and host-sync counting (bench/dispatch.py)


def test_dispatch_counter_counts_graph_nodes_and_syncs():
    import mlx.core as mx
    import numpy as np

    from bench.dispatch import count_dispatches

    original = (mx.eval, mx.array.item, np.asarray)
    a = mx.ones((8,))
    mx.eval(a)
    with count_dispatches() as c:
        mx.eval(a)  # already evaluated: nothing runs, no sync
        assert (c.dispatches["other"], c.syncs["other"]) == (0, 0)
        chain = a
        for _ in range(5):
            chain = mx.exp(chain)
        chain.sum().item()  # 5 Exp + a Sum (+ reshapes): one sync
        first = c.dispatches["other"]
        assert c.syncs["other"] == 1 and first >= 6 and c.ops["other"]["Exp"] == 5
        np.asarray(mx.sin(a))  # numpy reading a lazy array is a sync too
        assert c.syncs["other"] == 2 and c.ops["other"]["Sin"] == 1
        np.asarray(np.zeros(3))  # not an MLX array: not counted
        assert c.syncs["other"] == 2
    assert (mx.eval, mx.array.item, np.asarray) == original  # everything restored


def test_count_voicechat_stages(tiny_ckpt, long_question_wav):
    import voicechat
    from bench.dispatch import STAGES, count_voicechat

    compiled = voicechat.load(tiny_ckpt, policy=default_policy())
    assert compiled.policy.compiled
    rows = {r["stage"]: r for r in count_voicechat(compiled, long_question_wav, frames=6, drop_first=2)}
    assert set(rows) == {*STAGES, "total"}
    assert rows["total"]["dispatches_per_frame"] == sum(rows[s]["dispatches_per_frame"] for s in STAGES)
    for s in ("perception", "language", "tts", "codec"):
        assert rows[s]["dispatches_per_frame"] > 0, s
    assert rows["tts"]["syncs_per_frame"] >= 1  # the text id is read on the host before the TTS step
    plain = voicechat.load(tiny_ckpt, policy=default_policy(compiled=False))
    uncompiled = {r["stage"]: r for r in count_voicechat(plain, long_question_wav, frames=6, drop_first=2)}
    # compiled pieces fuse elementwise chains: strictly fewer dispatches where they are used
    assert rows["tts"]["dispatches_per_frame"] < uncompiled["tts"]["dispatches_per_frame"]
    assert rows["total"]["dispatches_per_frame"] < uncompiled["total"]["dispatches_per_frame"]


def test_resident_by_stage_counts_what_resident_bytes_counts(tiny_ckpt):
    """The bench's per-stage resident column and `voicechat.runtime.linear.resident_bytes` count the
    same arrays (one walk, `resident_arrays`): the stages sum to the model's resident bytes,
    numpy float32 copies of the codec's products included (once: those that view a parameter
    are that parameter)."""
    from mlx.utils import tree_flatten

    import voicechat
    from bench.floor import resident_bytes_by_stage
    from voicechat.runtime.linear import resident_bytes

    model = voicechat.load(tiny_ckpt, warmup=False, policy=default_policy(host_products=True))
    codec = model.tts_model.audio_codec
    with model.executing():
        mx.eval(codec.decode(np.zeros((2, codec.config.num_quantizers), dtype=np.int32)))
    host = [
        v
        for _, m in codec.named_modules()
        for _, v in m.__dict__.get("_derived", {}).values()
        if isinstance(v, np.ndarray)
    ]
    assert host  # the decode above made numpy's float32 W.T
    params = sum(a.nbytes for _, a in tree_flatten(codec.parameters()))
    # numpy's W.T of a weight `load` replaced by float32 views that parameter's buffer (counted
    # once, as the parameter); any other is a copy of its own
    float32_params = [np.asarray(a) for _, a in tree_flatten(codec.parameters()) if a.dtype == mx.float32]
    owned = sum(v.nbytes for v in host if not any(np.shares_memory(v, p) for p in float32_params))
    by_stage = resident_bytes_by_stage(model)
    assert by_stage["total"] == resident_bytes(model)
    assert by_stage["codec"] == resident_bytes(codec) >= params + owned


@pytest.mark.parametrize("warm", [True, False])
def test_checkpoint_files_are_read_before_each_run(tiny_ckpt_4bit, wav_path, tmp_path, monkeypatch, warm):
    """Every backend's load starts from the same page cache: the checkpoint's files are read in
    full before each run (all of its bytes, every file), and not at all with warm_page_cache off."""
    import bench.runner as runner

    calls = []
    real = runner.read_through

    def recording(folder, *a, **k):
        calls.append(real(folder, *a, **k))
        return calls[-1]

    monkeypatch.setattr(runner, "read_through", recording)
    opts = BenchOptions(
        checkpoints=[str(tiny_ckpt_4bit)],
        audio=[str(wav_path)],
        out=tmp_path / "run",
        backends=["voicechat", "voicechat-serial"],
        runs=1,
        warmup=1,
        drop_first=0,
        frames=2,
        offline=False,
        floor=False,
        plots=False,
        heartbeat_s=0,
        warm_page_cache=warm,
    )
    assert run_bench(opts, progress=Progress(stream=io.StringIO())).ok
    on_disk = sum(p.stat().st_size for p in Path(tiny_ckpt_4bit).iterdir() if p.is_file())
    assert calls == ([on_disk] * 4 if warm else [])  # (1 warm-up + 1 measured) x 2 backends
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["method"]["warm_page_cache"] is warm


def test_a_backend_that_times_only_whole_frames_has_its_stages_not_available():
    """mlx-audio's session reports each frame's wall time only: its rows carry the total and NaN
    stages (shown as not available), while a timing that lacks some stages is refused."""
    from bench.runner import STAGE_KEYS, _frame_rows

    rows = _frame_rows([{"frame_ms": 5.0}, {"frame_ms": 7.0}], drop_first=1, base={"backend": "mlx-audio"})
    assert [r["total_ms"] for r in rows] == [5.0, 7.0] and [r["dropped"] for r in rows] == [True, False]
    assert all(math.isnan(r[k]) for r in rows for k in STAGE_KEYS[:-1])
    with pytest.raises(ValueError, match="lacks"):
        _frame_rows([{"perception_ms": 1.0, "total_ms": 2.0}], drop_first=0, base={})


# -- `voicechat bench --sessions` (bench/sessions.py): ticks of N sessions in one batch

SESSION_COUNTS = (1, 2, 3)
SESSION_BACKENDS = ("voicechat", "voicechat-gpu-policy")
SESSION_TICKS, SESSION_DROP, SESSION_RUNS, SESSION_WARMUP = 6, 2, 2, 1


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks at (n - 1) q (numpy's and pandas' default), by hand."""
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _tick_stats(path: Path) -> dict:
    """{(checkpoint, backend, N): {ticks, mean, p50, p95, max}} from ticks.csv with the csv module only."""
    import csv

    pooled: dict = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["phase"] != "measured" or r["dropped"] == "True":
                continue
            pooled.setdefault((r["checkpoint"], r["backend"], int(r["sessions"])), []).append(float(r["tick_ms"]))
    return {
        k: {
            "ticks": len(v),
            "mean": sum(v) / len(v),
            "p50": _percentile(v, 0.50),
            "p95": _percentile(v, 0.95),
            "max": max(v),
        }
        for k, v in pooled.items()
    }


def _md_table(md: str, heading: str) -> list[list[str]]:
    """The body rows of the first table under `heading` in a Markdown page, as cells."""
    lines = md[md.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _shown(cell: str, value: float) -> None:
    """A number shown with k decimals is `value` rounded to k decimals (within half a unit of the last digit)."""
    text = cell.rstrip("×")
    decimals = len(text.split(".")[1]) if "." in text else 0
    assert abs(float(text) - value) <= 0.5 * 10**-decimals + 1e-9, (cell, value)


@pytest.fixture(scope="module")
def sessions_run(tmp_path_factory, tiny_ckpt_4bit, wav_path):
    """`voicechat bench --sessions 3,1,2` through the command line on the tiny 4-bit checkpoint."""
    from voicechat.cli.main import main

    out = tmp_path_factory.mktemp("sessions") / "run"
    argv = ["bench", "-m", str(tiny_ckpt_4bit), "--audio", str(wav_path), "--sessions", "3,1,2"]
    for b in SESSION_BACKENDS:
        argv += ["--backend", b]
    argv += ["--frames", str(SESSION_TICKS), "--drop-first", str(SESSION_DROP), "--runs", str(SESSION_RUNS)]
    argv += ["--warmup", str(SESSION_WARMUP), "--extra-decoding-seconds", "0", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    return {"out": out, "ckpt": str(tiny_ckpt_4bit)}


def test_sessions_run_writes_its_files(sessions_run):
    from bench.sessions import DISPATCH_COLUMNS, SESSIONS_COLUMNS, TICK_COLUMNS

    out = sessions_run["out"]
    for name in ("ticks.csv", "sessions.csv", "dispatch.csv", "env.json", "summary.md", "sessions.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    png = out / "sessions.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert list(pd.read_csv(out / "ticks.csv").columns) == TICK_COLUMNS
    assert list(pd.read_csv(out / "sessions.csv").columns) == SESSIONS_COLUMNS
    assert list(pd.read_csv(out / "dispatch.csv").columns) == DISPATCH_COLUMNS
    env = json.loads((out / "env.json").read_text())
    m = env["method"]
    assert m["sessions"] == list(SESSION_COUNTS) and m["backends"] == list(SESSION_BACKENDS)
    assert m["ticks_per_batch_run"] == SESSION_TICKS and m["seed"] == 0
    positions = m["prompt_positions"][sessions_run["ckpt"]]
    assert len(positions) == max(SESSION_COUNTS) and len(set(positions)) == len(positions)  # prompts differ
    assert len(set(m["system_prompts"])) == max(SESSION_COUNTS)


def test_sessions_ticks_are_interleaved_one_frame_per_session(sessions_run):
    import csv

    with open(sessions_run["out"] / "ticks.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    rounds = SESSION_WARMUP + SESSION_RUNS
    assert len(rows) == rounds * len(SESSION_COUNTS) * len(SESSION_BACKENDS) * SESSION_TICKS
    for r in rows:
        assert int(r["frames"]) == int(r["sessions"])  # every session computed its frame in every tick
        assert (r["dropped"] == "True") == (int(r["tick_index"]) < SESSION_DROP)
    # batch runs in file order: (phase, run, N, backend), each SESSION_TICKS ticks 0..5
    runs = []
    for i in range(0, len(rows), SESSION_TICKS):
        block = rows[i : i + SESSION_TICKS]
        assert [int(r["tick_index"]) for r in block] == list(range(SESSION_TICKS))
        assert len({(r["phase"], r["run"], r["sessions"], r["backend"]) for r in block}) == 1
        runs.append((block[0]["phase"], int(block[0]["run"]), int(block[0]["sessions"]), block[0]["backend"]))
    per_round = len(SESSION_COUNTS) * len(SESSION_BACKENDS)
    firsts = []
    for k in range(rounds):
        rnd = runs[k * per_round : (k + 1) * per_round]
        phase, run = ("warmup", k + 1) if k < SESSION_WARMUP else ("measured", k + 1 - SESSION_WARMUP)
        assert {(p, r) for p, r, _, _ in rnd} == {(phase, run)}
        # every N in the round, each under every backend in turn
        assert [b for _, _, _, b in rnd] == list(SESSION_BACKENDS) * len(SESSION_COUNTS)
        assert sorted({n for _, _, n, _ in rnd}) == list(SESSION_COUNTS)
        firsts.append(rnd[0][2])
    assert len(set(firsts)) == rounds  # the order of the N rotates: no N opens two rounds


def test_sessions_summary_matches_an_independent_recomputation(sessions_run):
    out = sessions_run["out"]
    stats = _tick_stats(out / "ticks.csv")
    ck = sessions_run["ckpt"]
    assert set(stats) == {(ck, b, n) for b in SESSION_BACKENDS for n in SESSION_COUNTS}
    for st in stats.values():
        assert st["ticks"] == SESSION_RUNS * (SESSION_TICKS - SESSION_DROP)
    summary = pd.read_csv(out / "sessions.csv")
    assert len(summary) == len(stats)
    for s in summary.itertuples():
        st, one = stats[(s.checkpoint, s.backend, s.sessions)], stats[(s.checkpoint, s.backend, 1)]
        assert s.ticks == st["ticks"]
        for col, key in (
            ("tick_mean_ms", "mean"),
            ("tick_p50_ms", "p50"),
            ("tick_p95_ms", "p95"),
            ("tick_max_ms", "max"),
        ):
            assert math.isclose(getattr(s, col), st[key], rel_tol=STAT_TOL), col
        assert math.isclose(s.p50_vs_1, st["p50"] / one["p50"], rel_tol=STAT_TOL)
        assert math.isclose(s.mean_vs_1, st["mean"] / one["mean"], rel_tol=STAT_TOL)
        assert math.isclose(s.rtf, st["mean"] / 80.0, rel_tol=STAT_TOL)
        assert bool(s.realtime_p95) == (st["p95"] < 80.0)
    md = (out / "summary.md").read_text()
    table = _md_table(md, "## Tick time against N")
    assert len(table) == len(stats)
    for cells in table:
        ckpt, backend, n, ticks, mean, p50, p95, mx_, r50, rmean, rtf, rt = cells
        st, one = stats[(ckpt.strip("`"), backend, int(n))], stats[(ckpt.strip("`"), backend, 1)]
        assert int(ticks) == st["ticks"]
        for cell, v in ((mean, st["mean"]), (p50, st["p50"]), (p95, st["p95"]), (mx_, st["max"])):
            _shown(cell, v)
        _shown(r50, st["p50"] / one["p50"])
        _shown(rmean, st["mean"] / one["mean"])
        _shown(rtf, st["mean"] / 80.0)
        assert rt == ("yes" if st["p95"] < 80.0 else "no")
    for cells in _md_table(md, "## Real-time capacity"):
        backend = cells[1]
        ok = [n for n in SESSION_COUNTS if stats[(ck, backend, n)]["p95"] < 80.0]
        assert cells[2].split(" ")[0] == (str(max(ok)) if ok else "none"), cells


def test_sessions_dispatch_counts_per_tick(sessions_run):
    out = sessions_run["out"]
    d = pd.read_csv(out / "dispatch.csv")
    stages = ["perception", "rnnt", "language", "tts", "codec"]
    assert len(d) == len(SESSION_BACKENDS) * len(SESSION_COUNTS) * (len(stages) + 1)
    assert (d.ticks_counted == SESSION_TICKS - SESSION_DROP).all()
    totals = {}
    for (be, n), g in d.groupby(["backend", "sessions"]):
        g = g.set_index("stage")
        assert list(g.index) == [*stages, "total"]
        assert math.isclose(g.loc["total", "dispatches_per_tick"], g.loc[stages, "dispatches_per_tick"].sum())
        assert math.isclose(g.loc["total", "syncs_per_tick"], g.loc[stages, "syncs_per_tick"].sum())
        assert (g.loc[["perception", "language", "tts", "codec"], "dispatches_per_tick"] > 0).all()
        totals[(be, int(n))] = g.loc["total", "dispatches_per_tick"]
    for be in SESSION_BACKENDS:  # every session's frame runs its own operations: more sessions, more of them
        assert totals[(be, 1)] < totals[(be, 2)] < totals[(be, 3)]
    table = _md_table((out / "summary.md").read_text(), "## Dispatches and host synchronisations per tick")
    total = d[d.stage == "total"]
    assert len(table) == len(total)
    for cells, r in zip(table, total.itertuples(), strict=True):
        assert (cells[1], int(cells[2])) == (r.backend, r.sessions)
        _shown(cells[3], r.dispatches_per_tick)
        _shown(cells[5], r.syncs_per_tick)


def test_sessions_stage_times_against_the_per_tick_floor(sessions_run, tiny_ckpt_4bit):
    """stages.csv: per backend, N and stage the profiled tick's milliseconds and the per-tick floor.
    The floor recomputed here from the config and the recorded bandwidth: the language stage's grows
    by one session's Mamba state traffic per added session; the other stages' (weights only) do not
    grow with N. The summary's table shows the CSV."""
    import voicechat
    from bench.sessions import STAGE_COLUMNS

    out = sessions_run["out"]
    st = pd.read_csv(out / "stages.csv")
    assert list(st.columns) == STAGE_COLUMNS
    stages = ["perception", "rnnt", "language", "tts", "codec"]
    assert len(st) == len(SESSION_BACKENDS) * len(SESSION_COUNTS) * (len(stages) + 1)
    bw = json.loads((out / "env.json").read_text())["bandwidth"]["f32"]["gbps"]
    t = voicechat.load(str(tiny_ckpt_4bit), warmup=False).config.text_config
    state_ms = 2 * t.hybrid_override_pattern.count("M") * t.mamba_num_heads * t.mamba_head_dim * t.ssm_state_size * 4
    state_ms = state_ms / (bw * 1e9) * 1e3
    assert state_ms > 0
    for (_be, n), g in st.groupby(["backend", "sessions"]):
        g = g.set_index("stage")
        assert (g.stage_ms > 0).all() and (g.ticks_profiled >= 1).all()
        # the stages follow one another inside the tick: their times add up to the tick's
        assert math.isclose(g.loc["total", "stage_ms"], g.loc[stages, "stage_ms"].sum(), rel_tol=1e-6)
        one = st[(st.backend == _be) & (st.sessions == 1)].set_index("stage")
        for stage in stages:
            grow = g.loc[stage, "floor_ms"] - one.loc[stage, "floor_ms"]
            want = (int(n) - 1) * state_ms if stage == "language" else 0.0
            assert math.isclose(grow, want, rel_tol=1e-9, abs_tol=1e-12), (stage, n, grow, want)
            assert math.isclose(g.loc[stage, "stage_vs_1"], g.loc[stage, "stage_ms"] / one.loc[stage, "stage_ms"])
    table = _md_table((out / "summary.md").read_text(), "## What bounds a tick: each stage against its floor")
    assert len(table) == len(st)
    for cells, r in zip(table, st.itertuples(), strict=True):
        assert (cells[1], int(cells[2]), cells[3]) == (r.backend, r.sessions, r.stage)
        _shown(cells[4], r.stage_ms)
        _shown(cells[6], r.floor_ms)


def test_tick_floor_needs_a_session_count():
    from bench.floor import StageBytes, tick_floor_ms

    bw = {f: {"gbps": 10.0} for f in ("bf16", "f32", "q4", "q8")}
    b = StageBytes("language", state_bytes=1e6)
    b.add("q4", 4e6)
    assert math.isclose(tick_floor_ms(b, bw, 3), (4e6 + 3e6) / 1e10 * 1e3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="sessions must be an int >= 1"):
            tick_floor_ms(b, bw, bad)


def _hand_made_ticks(path: Path, ckpt: str, p95s: dict[str, dict[int, float]]) -> None:
    """ticks.csv whose kept ticks of each backend x N all take p95s[backend][N] ms (so every statistic
    is that value), plus warm-up and dropped ticks far above 80 ms that must not count."""
    from bench.sessions import TICK_COLUMNS

    rows = []
    for be, by_n in p95s.items():
        for n, v in by_n.items():
            for phase, run in (("warmup", 1), ("measured", 1), ("measured", 2)):
                for t in range(6):
                    kept = phase == "measured" and t >= 2
                    rows.append([ckpt, be, "x.wav", phase, run, n, 0, t, v if kept else 1000.0 + t, n, t < 2])
    pd.DataFrame(rows, columns=TICK_COLUMNS).to_csv(path, index=False)


def test_capacity_rule_on_hand_made_ticks(sessions_run, tmp_path):
    """The largest N whose p95 tick is under 80 ms (strictly), 'none' when no N is; warm-up and
    dropped ticks do not count. Rendered from a hand-made ticks.csv with known answers."""
    from bench.sessions import capacities, capacity, render_sessions, summarize_ticks

    ck = sessions_run["ckpt"]
    p95s = {
        "voicechat": {1: 30.0, 2: 79.5, 4: 80.0, 8: 160.0},  # 80.0 is not under 80: capacity 2
        "voicechat-gpu-policy": {1: 80.5, 2: 150.0},  # even N=1 misses: none
        "voicechat-serial": {1: 10.0, 2: 20.0, 4: 40.0},  # all under: the largest N run
    }
    run = tmp_path / "hand"
    run.mkdir()
    _hand_made_ticks(run / "ticks.csv", ck, p95s)
    (run / "env.json").write_text((sessions_run["out"] / "env.json").read_text())
    summary = summarize_ticks(pd.read_csv(run / "ticks.csv"))
    assert summary.tick_p95_ms.tolist() == [v for by_n in p95s.values() for v in by_n.values()]
    assert (summary.ticks == 8).all()
    got = {c["backend"]: c["capacity"] for c in capacities(summary)}
    assert got == {"voicechat": 2, "voicechat-gpu-policy": None, "voicechat-serial": 4}
    assert capacity({1: 90.0, 2: 70.0}) == 2 and capacity({}) is None and capacity({1: math.nan}) is None
    cells = {c[1]: c[2] for c in _md_table(render_sessions(run), "## Real-time capacity")}
    assert cells["voicechat"] == "2"
    assert cells["voicechat-gpu-policy"].startswith("none")
    assert cells["voicechat-serial"].startswith("4 (the largest N run")


@pytest.mark.parametrize(
    "value, message",
    [
        ("0", "at least 1"),
        ("=-1", "at least 1"),
        ("-2", "at least 1"),
        ("1,-4", None),  # looks like an option to argparse: "expected one argument"
        ("=1,-4", "at least 1"),
        ("two", "not a whole number"),
        ("1.5", "not a whole number"),
        ("", "empty value"),
        ("1,,2", "empty item"),
        ("2,2", "repeated"),
    ],
)
def test_bad_sessions_values_are_argparse_errors(value, message, capsys):
    from voicechat.cli.main import main

    argv = ["bench", "-m", "synthetic:tiny:4", f"--sessions{value}"] if value.startswith("=") else None
    argv = argv or ["bench", "-m", "synthetic:tiny:4", "--sessions", value]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sessions" in err
    if message:
        assert message in err


def test_sessions_refuses_backends_without_a_batch(tiny_ckpt_4bit, wav_path, tmp_path, capsys):
    from voicechat.cli.main import main

    base = ["bench", "-m", str(tiny_ckpt_4bit), "--audio", str(wav_path), "--sessions", "1,2", "--quiet"]
    assert main([*base, "--backend", "mlx-vlm", "--out", str(tmp_path / "a")]) == 2
    assert "mlx-vlm" in capsys.readouterr().err
    assert main([*base, "--prompt-sweep", "19", "--out", str(tmp_path / "b")]) == 2
    assert "one at a time" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_sessions_docs_section_and_rerender(sessions_run, tmp_path):
    from bench.docs import markers
    from voicechat.cli.main import main

    out = sessions_run["out"]
    md = (out / "summary.md").read_text()
    assert main(["bench", "--rerender", str(out)]) == 0
    assert (out / "summary.md").read_text() == md  # from the folder's files only
    (tmp_path / "run").symlink_to(out, target_is_directory=True)
    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()
    page.write_text(f"# Performance\n\n{BEGIN}\nmain run\n{END}\n")
    assert update_docs(tmp_path / "run", page, "sessions")
    text = page.read_text()
    begin, end = markers("sessions")
    section = text[text.index(begin) : text.index(end)]
    assert f"{BEGIN}\nmain run\n{END}" in text  # the default section is untouched
    assert "tick time and real-time capacity against N" in section
    assert "## Real-time capacity" in section and "## Tick time against N" in section
    assert "](../run/sessions.png)" in section
    assert "--update-docs run --section sessions" in section
    assert not update_docs(tmp_path / "run", page, "sessions")
