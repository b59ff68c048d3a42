"""RNNT: memoised frame-by-frame decoding vs offline greedy, max_symbols, call counts, text rules."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from voicechat.model.audio.rnnt import RnntDecoder, RnntJoint, RnntStream, RnntText, RnntTranscript, greedy_decode
from voicechat.synthetic.presets import preset_config

CFG = preset_config("tiny")
AUDIO = CFG.audio_config
BLANK = AUDIO.decoder.vocab_size
D_ENC = AUDIO.encoder.d_model
MAX_SYMBOLS = AUDIO.max_symbols


class CountingDecoder(RnntDecoder):
    calls = 0

    def predict(self, token, state):
        self.calls += 1
        return super().predict(token, state)


def _models(blank_bias: float = 0.5, seed: int = 0):
    """Random tiny decoder + joint, rescaled so decisions mix blanks, short runs and
    max_symbols runs (plain random init emits either nothing or max_symbols)."""
    mx.random.seed(seed)
    dec = CountingDecoder(AUDIO)
    joint = RnntJoint(AUDIO)
    joint.pred.weight = joint.pred.weight * 6
    for cell in dec.prediction.dec_rnn.lstm:
        cell.Wx = cell.Wx * 3
    joint.joint_net[2].bias = joint.joint_net[2].bias.at[BLANK].add(blank_bias)
    enc = 2.0 * mx.random.normal((120, D_ENC))
    return dec, joint, enc


def _stream_all(dec, joint, enc, max_symbols=MAX_SYMBOLS, skip_ids=()):
    s = RnntStream(dec, joint, max_symbols, skip_ids)
    per_frame = [s.step(enc[t]) for t in range(enc.shape[0])]
    return s, per_frame


def test_parameter_names_and_shapes():
    mx.random.seed(0)
    dec, joint = RnntDecoder(AUDIO), RnntJoint(AUDIO)
    h, v = AUDIO.decoder.pred_hidden, AUDIO.decoder.vocab_size
    got = {k: a.shape for k, a in tree_flatten(dec.parameters())}
    expected = {"prediction.embed.weight": (v + 1, h)}
    for k in range(AUDIO.decoder.pred_rnn_layers):
        expected |= {
            f"prediction.dec_rnn.lstm.{k}.Wx": (4 * h, h),
            f"prediction.dec_rnn.lstm.{k}.Wh": (4 * h, h),
            f"prediction.dec_rnn.lstm.{k}.bias": (4 * h,),
        }
    assert got == expected
    j = AUDIO.joint.joint_hidden
    assert {k: a.shape for k, a in tree_flatten(joint.parameters())} == {
        "enc.weight": (j, D_ENC),
        "enc.bias": (j,),
        "pred.weight": (j, h),
        "pred.bias": (j,),
        "joint_net.2.weight": (v + 1, j),
        "joint_net.2.bias": (v + 1,),
    }


def _np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_prediction_and_joint_match_numpy():
    dec, joint, enc = _models()
    cells = [{k: np.array(v, np.float64) for k, v in c.parameters().items()} for c in dec.prediction.dec_rnn.lstm]
    emb = np.array(dec.prediction.embed.weight, np.float64)
    state = None
    hs = [np.zeros(AUDIO.decoder.pred_hidden)] * len(cells)
    cs = [np.zeros(AUDIO.decoder.pred_hidden)] * len(cells)
    for token in [BLANK, 3, 7, 0, 15]:
        out, state = dec.predict(token, state)
        x = np.zeros(AUDIO.decoder.pred_hidden) if token == BLANK else emb[token]
        for k, c in enumerate(cells):
            i, f, g, o = np.split(c["Wx"] @ x + c["Wh"] @ hs[k] + c["bias"], 4)
            cs[k] = _np_sigmoid(f) * cs[k] + _np_sigmoid(i) * np.tanh(g)
            hs[k] = _np_sigmoid(o) * np.tanh(cs[k])
            x = hs[k]
        # float32 vs float64 over two 16-wide layers: errors ~1e-7
        np.testing.assert_allclose(np.array(out), x, atol=1e-5)
    p = {k: np.array(v, np.float64) for k, v in tree_flatten(joint.parameters())}
    e = np.array(enc[0], np.float64)
    ref = (
        p["joint_net.2.weight"]
        @ np.maximum(0, p["enc.weight"] @ e + p["enc.bias"] + p["pred.weight"] @ x + p["pred.bias"])
        + p["joint_net.2.bias"]
    )
    np.testing.assert_allclose(np.array(joint(enc[0], out)), ref, atol=1e-4)


def test_stream_matches_offline_greedy():
    dec, joint, enc = _models()
    offline = greedy_decode(dec, joint, enc, MAX_SYMBOLS)
    s, per_frame = _stream_all(dec, joint, enc)
    assert [t for f in per_frame for t in f] == offline == s.state.tokens
    counts = [len(f) for f in per_frame]
    # the scenario exercises every branch: blank frames, short runs, capped runs
    assert 0 in counts and MAX_SYMBOLS in counts and any(0 < c < MAX_SYMBOLS for c in counts)
    assert len(set(offline)) > 3


def test_special_ids_drive_decoder_but_are_not_returned():
    dec, joint, enc = _models()
    text = RnntText(CFG.rnnt_vocabulary)
    assert text.special_ids == {0, 1}  # <unk>, <en-US>
    everything = greedy_decode(dec, joint, enc, MAX_SYMBOLS)
    visible = greedy_decode(dec, joint, enc, MAX_SYMBOLS, skip_ids=text.special_ids)
    assert visible == [t for t in everything if t not in text.special_ids]
    s, _per_frame = _stream_all(dec, joint, enc, skip_ids=text.special_ids)
    assert s.state.tokens == visible


@pytest.mark.parametrize("max_symbols", [1, 3, MAX_SYMBOLS])
def test_max_symbols_respected(max_symbols):
    dec, joint, enc = _models(blank_bias=-1e9)  # blank never wins
    enc = enc[:20]
    offline = greedy_decode(dec, joint, enc, max_symbols)
    assert len(offline) == 20 * max_symbols
    s, per_frame = _stream_all(dec, joint, enc, max_symbols=max_symbols)
    assert [len(f) for f in per_frame] == [max_symbols] * 20
    assert s.state.tokens == offline
    with pytest.raises(ValueError, match="max_symbols"):
        RnntStream(dec, joint, 0)


def test_prediction_runs_once_per_symbol_not_per_frame():
    dec, joint, enc = _models()
    dec.calls = 0
    s, per_frame = _stream_all(dec, joint, enc)
    emitted = sum(len(f) for f in per_frame)  # no skip ids: every emission is returned
    pending = 0 if s.state.pred_out is not None else 1  # computed lazily on the next frame
    assert dec.calls == s.state.prediction_calls == 1 + emitted - pending
    blank_frames = sum(1 for f in per_frame if not f)
    assert blank_frames > 10  # a per-frame re-run would have cost this many extra calls

    dec.calls = 0
    greedy_decode(dec, joint, enc, MAX_SYMBOLS)
    assert dec.calls > 1 + emitted  # the offline reference re-runs it every frame

    dec2, joint2, enc2 = _models(blank_bias=1e9)  # all blank
    dec2.calls = 0
    _s2, per_frame2 = _stream_all(dec2, joint2, enc2[:50])
    assert all(not f for f in per_frame2) and dec2.calls == 1


def test_state_copy_reset_and_arrays():
    dec, joint, enc = _models()
    s = RnntStream(dec, joint, MAX_SYMBOLS)
    for t in range(30):
        s.step(enc[t])
    saved = s.state.copy()
    a = [s.step(enc[t]) for t in range(30, 60)]
    s.state = saved
    b = [s.step(enc[t]) for t in range(30, 60)]
    assert a == b
    arr = s.state.arrays()
    assert "last_token" in arr and "lstm.0.h" in arr and "lstm.1.c" in arr
    s.reset()
    assert s.state.tokens == [] and s.state.last_token == BLANK and s.state.lstm is None
    with pytest.raises(ValueError, match="shape"):
        s.step(enc[:2])


def test_text_decoding_rules():
    vocab = ["<unk>", "▁hel", "lo", "▁wor", "ld", "<en-US>", "<pad>", "<s>", "</s>", "<fra-FR>", "<EN-us>", "▁", "!"]
    text = RnntText(vocab)
    assert text.special_ids == {0, 5, 6, 7, 8, 9}  # <EN-us> does not match the tag pattern
    assert text.decode([5, 1, 2, 0, 3, 4, 12]) == "hello world!"
    assert text.decode([1, 2, 99, -1, 3, 4]) == "hello world"  # out-of-range ids skipped
    assert text.decode([11, 1, 2, 11]) == "hello"  # stripped
    assert text.decode([10]) == "<EN-us>"
    assert text.decode([]) == ""


def test_incremental_transcript():
    vocab = ["<unk>", "▁hel", "lo", "▁wor", "ld", "<en-US>", "▁", "!"]
    text = RnntText(vocab)
    tr = RnntTranscript(text)
    steps = [[5], [6], [1], [], [2, 0], [6], [3, 4], [7], [99]]
    seen, deltas = [], []
    for new in steps:
        seen += new
        delta, cumulative = tr.add(new)
        assert cumulative == text.decode(seen)  # same as re-decoding everything
        deltas.append(delta)
    # a lone '▁' piece is a space that only shows once text follows it
    assert "".join(deltas) == "hello  world!" == tr.text
    assert deltas[:3] == ["", "", "hel"] and deltas[5] == "" and deltas[6] == "  world"


@pytest.mark.parametrize("blank_bias,max_symbols", [(0.5, MAX_SYMBOLS), (-1e9, 3), (1e9, MAX_SYMBOLS), (0.5, 1)])
def test_on_device_loop_makes_the_host_loops_decisions(blank_bias, max_symbols):
    """`step_on_device` (ExecutionPolicy.rnnt_on_device: every iteration runs, symbols after the
    first blank masked out, ids read once per frame) emits what `step` emits, frame by frame,
    with the same state bit for bit: the masked arithmetic selects, never recomputes, values.
    Covers blanks, short runs, max_symbols runs (blank never wins) and blank always winning."""
    dec, joint, enc = _models(blank_bias=blank_bias)
    enc = enc[:40]
    host, host_frames = _stream_all(dec, joint, enc, max_symbols=max_symbols, skip_ids={3})
    device = RnntStream(dec, joint, max_symbols, {3})
    device_frames = []
    for t in range(enc.shape[0]):
        ids = device.step_on_device(enc[t])
        assert ids.shape == (max_symbols,)
        device_frames.append(device.finish_on_device(ids))
        want = {k: np.array(v) for k, v in host.state.arrays().items()} if t == enc.shape[0] - 1 else None
    assert device_frames == host_frames
    assert (
        device.state.tokens == host.state.tokens == [k for k in greedy_decode(dec, joint, enc, max_symbols) if k != 3]
    )
    got = {k: np.array(v) for k, v in device.state.arrays().items()}
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)
    device.step_on_device(enc[0])
    with pytest.raises(RuntimeError, match="not finished"):
        device.step_on_device(enc[1])
