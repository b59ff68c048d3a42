"""Prompt states (api.md, "Prompt state"; voicechat/streaming/prompt_state.py): a session or an offline run from
`model.prepare_prompt(...)`'s state equals one that prefilled the same prompt, bit for bit, at the
real geometry (`small16`: 31 codebooks, the real depth) at 4 and 8 bits, with and without tools;
the state is never changed by its sessions; files refuse every mismatch and corruption."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import voicechat
from parity_tests.conftest import TIME_TOOL
from voicechat.errors import PromptStateError

PROMPT = "You are a helpful assistant. Answer in one short sentence."
FRAMES = 14


@pytest.fixture(scope="module", params=[4, 8])
def real_model(request, tmp_path_factory):
    """small16 at 4 / 8 bits: the published layout at the real depth and frame geometry."""
    from voicechat.io.tokenizer import write_synthetic_tokenizer
    from voicechat.synthetic.checkpoint import write_checkpoint
    from voicechat.synthetic.toolcall import SPECIAL_COUNT

    path = write_checkpoint(
        tmp_path_factory.mktemp(f"small16_{request.param}bit"), "small16", bits=request.param, progress=False
    )
    # With the function channel's markers (<SPECIAL_20..22>), as the toolcall preset's tokenizer has them,
    # so the same checkpoint takes tools (the random weights then only prefill the tools block).
    write_synthetic_tokenizer(path, 8192, SPECIAL_COUNT)
    m = voicechat.load(path)
    assert m.config.codec_config.num_quantizers == 31 and m.config.text_config.num_hidden_layers == 56
    return m


@pytest.fixture(scope="module")
def audio(question_wav):
    return question_wav[: 1280 * FRAMES + 700]


def _events_bytes(events) -> list:
    """Events with every field, arrays by dtype, shape and bytes (no tolerance: bit for bit)."""
    out = []
    for e in events:
        d = {}
        for k, v in e.__dict__.items():
            d[k] = (str(v.dtype), v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v
        out.append((e.kind, d))
    return out


def _raw(a) -> bytes:
    import mlx.core as mx

    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def _states_bytes(session) -> dict:
    return {k: (str(v.dtype), tuple(v.shape), _raw(v)) for k, v in session.states().items()}


def _stream(model, audio, push=1280, **kw):
    s = model.create_streaming_session(**kw)
    start = _states_bytes(s)
    events = []
    for i in range(0, audio.size, push):
        events += s.push_audio(audio[i : i + push])
    events += s.flush()
    return s, start, events


def _assert_same_run(a, b):
    (sa, start_a, ev_a), (sb, start_b, ev_b) = a, b
    assert start_a == start_b  # every cache family right after the session starts
    assert sa.prompt_positions == sb.prompt_positions > 0
    assert _events_bytes(ev_a) == _events_bytes(ev_b)
    assert sa.text_ids == sb.text_ids and sa.function_ids == sb.function_ids
    assert sa.transcript_tokens == sb.transcript_tokens
    assert np.array_equal(np.stack(sa.raw_audio_codes), np.stack(sb.raw_audio_codes))
    assert _states_bytes(sa) == _states_bytes(sb)  # and after the last frame


def _state_bytes(state) -> dict:
    return {k: _raw(v) for k, v in state._arrays().items()}


@pytest.fixture(scope="module", params=[None, [TIME_TOOL]], ids=["no-tools", "tools"])
def prefilled(request, real_model, audio, tmp_path_factory):
    """One prompt (with or without the tools block, ~500 more positions) per model: its state, the state
    through a file, and the prefilling runs (streamed and offline) the tests compare against. Made once:
    a prefill at this geometry costs ~30 ms a position on a 2-core CPU."""
    tools = request.param
    state = real_model.prepare_prompt(PROMPT, tools=tools, seed=7)
    path = state.save(tmp_path_factory.mktemp("state") / "p.safetensors")
    loaded = voicechat.PromptState.load(path, real_model)
    streamed = _stream(real_model, audio, system_prompt=PROMPT, tools=tools, seed=7)
    # Offline with the tools block: test_offline_with_tools_from_state_at_real_geometry (`slow`: two more
    # 500-position prefills per bit width).
    offline = None if tools else real_model.generate(audio, system_prompt=PROMPT, seed=7)
    return tools, state, loaded, streamed, offline


def test_streamed_from_state_equals_prefilled_at_real_geometry(real_model, audio, prefilled):
    tools, state, _, ref, _ = prefilled
    got = _stream(real_model, audio, push=997, prompt_state=state)  # another push size: events do not depend on it
    _assert_same_run(ref, got)
    assert len([e for e in ref[2] if e.kind == "audio"]) == FRAMES + 1  # the padded partial frame
    assert len(set(map(int, ref[0].text_ids))) > 1  # the run is not degenerate (ids vary)
    assert len(state.tools) == (1 if tools else 0)
    if tools:
        assert state.prompt_positions > 400  # the tools block was prefilled


def _assert_same_offline(a, b):
    assert b.prompt_positions == a.prompt_positions
    assert np.array_equal(a.text_tokens, b.text_tokens) and np.array_equal(a.function_tokens, b.function_tokens)
    assert np.array_equal(a.raw_audio_codes, b.raw_audio_codes) and np.array_equal(a.audio_codes, b.audio_codes)
    assert a.audio.tobytes() == b.audio.tobytes() and a.text == b.text


def test_offline_from_state_equals_prefilled_at_real_geometry(real_model, audio, prefilled):
    tools, state, _, _, a = prefilled
    if tools:
        pytest.skip("offline with tools: test_offline_with_tools_from_state_at_real_geometry (slow)")
    b = real_model.generate(audio, prompt_state=state)
    assert b.prompt_positions == a.prompt_positions == state.prompt_positions
    assert np.array_equal(a.text_tokens, b.text_tokens) and np.array_equal(a.function_tokens, b.function_tokens)
    assert np.array_equal(a.raw_audio_codes, b.raw_audio_codes) and np.array_equal(a.audio_codes, b.audio_codes)
    assert a.audio.tobytes() == b.audio.tobytes() and a.text == b.text


def test_state_through_a_file_equals_prefilled(real_model, audio, prefilled):
    _, state, loaded, ref, off = prefilled
    assert loaded.system_prompt == PROMPT and loaded.seed == 7 and loaded.tools == state.tools
    assert loaded.prompt_positions == state.prompt_positions and loaded.nbytes == state.nbytes
    assert _state_bytes(loaded) == _state_bytes(state)
    _assert_same_run(ref, _stream(real_model, audio, prompt_state=loaded))
    if off is not None:
        assert real_model.generate(audio, prompt_state=loaded).audio.tobytes() == off.audio.tobytes()


@pytest.mark.slow
def test_offline_with_tools_from_state_at_real_geometry(real_model, audio):
    state = real_model.prepare_prompt(PROMPT, tools=[TIME_TOOL], seed=7)
    _assert_same_offline(
        real_model.generate(audio, system_prompt=PROMPT, tools=[TIME_TOOL], seed=7),
        real_model.generate(audio, prompt_state=state),
    )


def test_one_state_serves_sessions_side_by_side_and_is_never_changed(real_model, audio):
    state = real_model.prepare_prompt(PROMPT, seed=3)
    before = _state_bytes(state)
    ref = _stream(real_model, audio, system_prompt=PROMPT, seed=3)
    # Two sessions from the same state, interleaved frame by frame, then a third one after them.
    s1 = real_model.create_streaming_session(prompt_state=state)
    s2 = real_model.create_streaming_session(prompt_state=state)
    e1, e2 = [], []
    for i in range(0, audio.size, 1280):
        e1 += s1.push_audio(audio[i : i + 1280])
        e2 += s2.push_audio(audio[i : i + 1280])
    e1 += s1.flush()
    e2 += s2.flush()
    assert _events_bytes(e1) == _events_bytes(ref[2]) == _events_bytes(e2)
    assert _state_bytes(state) == before
    _assert_same_run(ref, _stream(real_model, audio, prompt_state=state))
    assert _state_bytes(state) == before


def test_state_holds_no_copy_of_the_model(real_model):
    import mlx.utils

    params = {id(a) for _, a in mlx.utils.tree_flatten(real_model.parameters())}
    state = real_model.prepare_prompt(PROMPT)
    arrays = state._arrays()
    assert not params & {id(a) for a in arrays.values()}
    assert state.nbytes == sum(a.nbytes for a in arrays.values())
    from voicechat.streaming.prompt_state import state_nbytes

    assert state.nbytes == state_nbytes(real_model.config, state.prompt_positions)  # the documented formula
    # An empty prompt leaves the TTS warm-up as it is: the state holds the model's buffers, uncounted.
    empty = real_model.prepare_prompt("")
    assert empty.prompt_positions == 0
    warm = real_model._warm_tts
    assert all(a is b for a, b in zip(empty._timeline.tts.keys, warm.keys, strict=True))
    tts_warm = sum(a.nbytes for a in warm.keys + warm.values)
    # Counted: the fresh language state (zeros), the random key and the ids; not the warm-up.
    assert 0 <= empty.nbytes - empty._timeline.llm.nbytes < 1024 < tts_warm < state.nbytes


def test_toolcall_loop_from_state(toolcall_model):
    """The scripted call (the toolcall preset) runs the same from a state: call, forced result, EOTR."""
    from parity_tests.conftest import TOOLCALL_TOOL

    wave = np.zeros(1280 * 150, np.float32)
    state = toolcall_model.prepare_prompt(None, tools=[TIME_TOOL])
    state.tools[0]["name"] = "changed"  # a copy: the state's own tools stay as they were
    assert state.tools[0]["name"] == TOOLCALL_TOOL

    def run(**kw):
        s = toolcall_model.create_streaming_session(**kw)
        events = []
        for i in range(0, wave.size, 1280):
            events += s.push_audio(wave[i : i + 1280])
            for call_id in s.pending_tool_calls:
                s.submit_tool_result(call_id, {"datetime": "2026-12-04T09:00:00+00:00"})
        return events + s.flush()

    ref, got = run(tools=[TIME_TOOL]), run(prompt_state=state)
    assert _events_bytes(ref) == _events_bytes(got)
    call = next(e for e in got if e.kind == "tool_call")
    schedule = [(call.frame_index, call.call_id, {"datetime": "2026-12-04T09:00:00+00:00"})]
    _assert_same_offline(
        toolcall_model.generate(wave, tools=[TIME_TOOL], tool_results=schedule),
        toolcall_model.generate(wave, prompt_state=state, tool_results=schedule),
    )
    kinds = [e.kind for e in got]
    assert "tool_call" in kinds and "tool_result_done" in kinds
    assert next(e for e in got if e.kind == "tool_call").name == TOOLCALL_TOOL


def test_disagreeing_arguments_are_refused(tiny_model):
    state = tiny_model.prepare_prompt("Be brief.", seed=2)
    for kw, word in [
        ({"system_prompt": "Be long."}, "system_prompt"),
        ({"system_prompt": None}, "system_prompt"),
        ({"seed": 0}, "seed"),
        ({"tools": [TIME_TOOL]}, "tools"),
        ({"use_language_cache": False}, "use_language_cache"),
    ]:
        with pytest.raises(ValueError, match=word):
            tiny_model.create_streaming_session(prompt_state=state, **kw)
        if "use_language_cache" not in kw:
            with pytest.raises(ValueError, match=word):
                tiny_model.generate(np.zeros(2560, np.float32), prompt_state=state, **kw)
    # The same values given explicitly are fine.
    s = tiny_model.create_streaming_session(prompt_state=state, system_prompt="Be brief.", seed=2, tools=None)
    assert s.prompt_positions == state.prompt_positions
    default = tiny_model.prepare_prompt()  # the config's default prompt, given as None or as its text
    tiny_model.create_streaming_session(prompt_state=default, system_prompt=tiny_model.config.default_system_prompt)
    with pytest.raises(TypeError, match="PromptState"):
        tiny_model.create_streaming_session(prompt_state="state.safetensors")


def test_state_of_another_model_is_refused_in_memory(tiny_model, tiny_model_4bit):
    state = tiny_model.prepare_prompt("Be brief.")
    with pytest.raises(PromptStateError, match="another checkpoint"):
        tiny_model_4bit.create_streaming_session(prompt_state=state)
    # The same checkpoint loaded again is the same model: accepted.
    again = voicechat.load(tiny_model.folder)
    s = again.create_streaming_session(prompt_state=state)
    assert s.prompt_positions == state.prompt_positions


@pytest.fixture
def saved(tiny_model, tmp_path):
    state = tiny_model.prepare_prompt("Be brief.", seed=4)
    return state, state.save(tmp_path / "state.safetensors")


def test_file_for_another_checkpoint_is_refused(saved, tiny_model_4bit):
    with pytest.raises(PromptStateError, match="another checkpoint"):
        voicechat.PromptState.load(saved[1], tiny_model_4bit)


def test_file_for_other_numerics_is_refused(saved, tiny_ckpt):
    other = voicechat.load(tiny_ckpt, numerics="float32")
    with pytest.raises(PromptStateError, match="setting 'reference' \\(the model: 'float32'\\)"):
        voicechat.PromptState.load(saved[1], other)


def _rewrite_meta(path, change):
    """Rewrite the state's JSON metadata in place (same length is not needed: the header is rebuilt)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    md = header["__metadata__"]
    meta = json.loads(md["voicechat.prompt_state"])
    change(meta)
    md["voicechat.prompt_state"] = json.dumps(meta, sort_keys=True)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_file_of_another_format_version_is_refused(saved, tiny_model):
    _rewrite_meta(saved[1], lambda m: m.update(format_version=2))
    with pytest.raises(PromptStateError, match="format version 2"):
        voicechat.PromptState.load(saved[1], tiny_model)


def test_edited_metadata_is_refused_as_corrupt(saved, tiny_model):
    _rewrite_meta(saved[1], lambda m: m.update(seed=5))  # a valid-looking file whose digest no longer fits
    with pytest.raises(PromptStateError, match="SHA-256"):
        voicechat.PromptState.load(saved[1], tiny_model)


@pytest.mark.parametrize("cut", [1, 1000, "header"])
def test_truncated_file_is_refused(saved, tiny_model, cut):
    path = saved[1]
    data = path.read_bytes()
    path.write_bytes(data[:20] if cut == "header" else data[:-cut])
    with pytest.raises(PromptStateError, match="truncated"):
        voicechat.PromptState.load(path, tiny_model)


def test_flipped_data_byte_is_refused(saved, tiny_model):
    path = saved[1]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(PromptStateError, match="corrupt"):
        voicechat.PromptState.load(path, tiny_model)


def test_missing_file_and_not_a_state(tiny_model, tiny_ckpt, tmp_path):
    with pytest.raises(PromptStateError, match="no such"):
        voicechat.PromptState.load(tmp_path / "none.safetensors", tiny_model)
    shard = sorted(tiny_ckpt.glob("*.safetensors"))[0]
    with pytest.raises(PromptStateError, match="not a voicechat prompt state"):
        voicechat.PromptState.load(shard, tiny_model)


def test_harness_rows_pass_and_fail(tiny_model, question_wav, monkeypatch):
    from harness.families import FAIL, PASS
    from harness.prompt_state_rows import prompt_state_rows

    wave = question_wav[: 1280 * 6]
    rows = prompt_state_rows(tiny_model, wave, system_prompt="Be brief.", seed=1)
    assert rows and all(r.status == PASS for r in rows), [(r.metric, r.observed) for r in rows if r.status != PASS]
    # A state whose random stream was not restored: the rows must see it.
    from voicechat.streaming.prompt_state import PromptState

    real = PromptState.restore

    def no_rng(self, timeline):
        n = real(self, timeline)
        timeline.state.rng.reset()
        return n

    monkeypatch.setattr(PromptState, "restore", no_rng)
    rows = prompt_state_rows(tiny_model, wave, system_prompt="Be brief.", seed=1, through_file=False)
    assert any(r.status == FAIL for r in rows)


def test_cli_cache_prompt_then_generate(tiny_ckpt, tiny_ckpt_4bit, tmp_path, capsys):
    import soundfile as sf

    from voicechat.cli.main import main

    state = tmp_path / "s.safetensors"
    assert main(["cache-prompt", "-m", str(tiny_ckpt), "-p", "Be brief.", "--seed", "2", "-o", str(state)]) == 0
    assert "prompt positions" in capsys.readouterr().out
    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    for stream in ([], ["--stream"]):
        assert (
            main(
                [
                    "generate",
                    "-m",
                    str(tiny_ckpt),
                    "--prompt-state",
                    str(state),
                    "--output-audio",
                    str(a),
                    "--output-format",
                    "float32",
                    "--quiet",
                    *stream,
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "generate",
                    "-m",
                    str(tiny_ckpt),
                    "-p",
                    "Be brief.",
                    "--seed",
                    "2",
                    "--output-audio",
                    str(b),
                    "--output-format",
                    "float32",
                    "--quiet",
                    *stream,
                ]
            )
            == 0
        )
        wa, wb = sf.read(a, dtype="float32")[0], sf.read(b, dtype="float32")[0]
        assert wa.size > 0 and wa.tobytes() == wb.tobytes()
    capsys.readouterr()
    # A disagreeing seed and another checkpoint: one clear line each, exit status 2.
    assert (
        main(
            [
                "generate",
                "-m",
                str(tiny_ckpt),
                "--prompt-state",
                str(state),
                "--seed",
                "3",
                "--output-audio",
                str(a),
                "--quiet",
            ]
        )
        == 2
    )
    assert "disagrees with the prompt_state's seed 2" in capsys.readouterr().err
    assert (
        main(["generate", "-m", str(tiny_ckpt_4bit), "--prompt-state", str(state), "--output-audio", str(a), "--quiet"])
        == 2
    )
    assert "another checkpoint" in capsys.readouterr().err


def test_bench_prompt_sweep(tiny_ckpt, tmp_path):
    from bench.docs import update_docs
    from bench.prompt_sweep import prompt_of_positions
    from voicechat.cli.main import main

    m = voicechat.load(tiny_ckpt)
    for n in (5, 19, 95):
        assert m.prepare_prompt(prompt_of_positions(m, n)).prompt_positions == n
    out = tmp_path / "sweep"
    assert (
        main(["bench", "-m", str(tiny_ckpt), "--prompt-sweep", "5,19", "--runs", "2", "--out", str(out), "--quiet"])
        == 0
    )
    lines = (out / "prompt_sweep.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * 2 and lines[0].startswith("checkpoint,positions,run,")
    rows = [dict(zip(lines[0].split(","), line.split(","), strict=True)) for line in lines[1:]]
    assert [int(r["positions"]) for r in rows] == [5, 5, 19, 19]
    assert all(float(r["state_bytes"]) > 0 and float(r["prepare_s"]) > 0 for r in rows)
    page = tmp_path / "perf.md"
    page.write_text("# Performance\n")
    assert update_docs(out, page, "prompt_sweep")
    text = page.read_text()
    assert "Prompt states: session start per prompt length" in text and "| 19 |" in text


def test_state_bytes_formula_at_every_capacity_step(tiny_model):
    """`state_nbytes` (docs' per-preset table) equals `nbytes` across the 256-position K/V steps."""
    from bench.prompt_sweep import prompt_of_positions
    from voicechat.streaming.prompt_state import state_nbytes

    sizes = []
    for n in (0, 3, 219, 220, 221, 476, 477, 600):
        state = tiny_model.prepare_prompt(prompt_of_positions(tiny_model, n) if n else "")
        assert state.prompt_positions == n
        assert state.nbytes == state_nbytes(tiny_model.config, n), n
        sizes.append(state.nbytes)
    assert sizes == sorted(sizes) and len(set(sizes)) >= 4  # it grows, in steps


def _write_v1(state, path):
    """A prompt-state file exactly as the writer before `state` / `meta_state` wrote it (format
    version 1; the writer's code, frozen here): the layout every later reader must read."""
    import hashlib

    import mlx.core as mx

    from voicechat._version import __version__
    from voicechat.model.llm.nemotron_h import MambaLayerState
    from voicechat.streaming.prompt_identity import checkpoint_identity

    ts, rows = state._timeline, dict(state._text_rows._rows)
    arrays = {}
    for i, layer in enumerate(ts.llm.layers):
        if layer is None:
            continue
        if isinstance(layer, MambaLayerState):
            arrays[f"llm.{i}.conv"], arrays[f"llm.{i}.ssm"] = layer.conv, layer.ssm
        else:
            arrays[f"llm.{i}.keys"], arrays[f"llm.{i}.values"] = layer.keys, layer.values
    for i in range(ts.tts.num_layers):
        arrays[f"tts.{i}.keys"], arrays[f"tts.{i}.values"] = ts.tts.keys[i], ts.tts.values[i]
    arrays["tts.previous_codes"] = ts.tts.previous_codes
    arrays["rng.key"] = ts.rng.arrays()["key"]
    arrays["prev_text"], arrays["prev_function"] = ts.prev_text, ts.prev_function
    for token, row in rows.items():
        arrays[f"text_rows.{token}"] = row
    meta = {
        "format": "voicechat-prompt-state",
        "format_version": 1,
        "voicechat": __version__,
        "checkpoint": checkpoint_identity(state._model_ref()),
        "numerics": state.numerics,
        "system_prompt": state.system_prompt,
        "tools": list(state.tools),
        "seed": state.seed,
        "prompt_positions": state.prompt_positions,
        "position": ts.position,
        "llm": {
            "offset": ts.llm.offset,
            "layers": [
                None if s is None else ("mamba" if isinstance(s, MambaLayerState) else ["attention", s.length])
                for s in ts.llm.layers
            ],
        },
        "tts": {"offset": ts.tts.offset, "ring_origin": list(ts.tts.ring_origin), "windows": list(ts.tts.windows)},
        "rng": {"seed": ts.rng.seed, "draws": ts.rng.draws},
        "text_rows": [int(t) for t in rows],
    }
    meta_text = json.dumps(meta, sort_keys=True)
    mx.eval(list(arrays.values()))
    h = hashlib.sha256(meta_text.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{tuple(a.shape)}".encode())
        h.update(np.ascontiguousarray(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)).tobytes())
    mx.save_safetensors(
        str(path),
        arrays,
        metadata={"voicechat.prompt_state": meta_text, "voicechat.prompt_state.sha256": h.hexdigest()},
    )
    return path


def _timeline_bookkeeping(state) -> tuple:
    ts = state._timeline
    return (
        ts.position,
        ts.llm.offset,
        [getattr(s, "length", None) for s in ts.llm.layers],
        ts.tts.offset,
        list(ts.tts.ring_origin),
        ts.rng.seed,
        ts.rng.draws,
        list(state._text_rows._rows),
    )


@pytest.mark.parametrize("which", ["prompt", "empty", "tools"])
def test_files_written_before_states_described_themselves_load_bit_for_bit(which, tiny_model, toolcall_model, tmp_path):
    """A format-version-1 file written the old way (`_write_v1`) loads to the same arrays, bookkeeping
    and prompt arguments, and today's writer writes the very same bytes."""
    if which == "tools":
        model, state = toolcall_model, toolcall_model.prepare_prompt("Be brief.", tools=[TIME_TOOL], seed=3)
    else:
        model, state = tiny_model, tiny_model.prepare_prompt("Be brief." if which == "prompt" else "", seed=4)
    old = _write_v1(state, tmp_path / "old.safetensors")
    loaded = voicechat.PromptState.load(old, model)
    assert list(loaded._arrays()) == list(state._arrays())
    assert _state_bytes(loaded) == _state_bytes(state)
    assert {k: (v.dtype, v.shape) for k, v in loaded._arrays().items()} == {
        k: (v.dtype, v.shape) for k, v in state._arrays().items()
    }
    assert _timeline_bookkeeping(loaded) == _timeline_bookkeeping(state)
    assert (loaded.system_prompt, loaded.tools, loaded.seed, loaded.prompt_positions) == (
        state.system_prompt,
        state.tools,
        state.seed,
        state.prompt_positions,
    )
    assert state.save(tmp_path / "new.safetensors").read_bytes() == old.read_bytes()
    assert loaded.save(tmp_path / "again.safetensors").read_bytes() == old.read_bytes()
