"""RNNT transcript branch (docs/model.md §6.2-§6.5). Owns `rnnt_decoder.` and `rnnt_joint.`.

* `RnntDecoder`: prediction network (embedding + stacked LSTM cells, gates i, f, g, o).
* `RnntJoint`: logits = joint_net.2(ReLU(enc(enc) + pred(pred))).
* `greedy_decode`: offline greedy decoding over all encoder frames; it re-runs
  the prediction net at the start of every frame like the reference (§6.4).
* `RnntStream` + `RnntState`: the same decisions one encoder frame at a time,
  with the prediction output memoised in the state: the prediction net runs
  once at the start and once after each emitted symbol, never just because a
  new frame arrived.
* `RnntText` / `RnntTranscript`: SentencePiece pieces -> text, incrementally.

The blank id is the prediction vocabulary size (`rnnt_blank_id`,
docs/model.md §6.3); the joint has vocab_size + 1 outputs.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model import ops
from voicechat.model.config import AudioConfig

# --------------------------------------------------------------------------- prediction net


class LstmCell(nn.Module):
    """One LSTM layer step: Wx (4h, in), Wh (4h, h), bias (4h) = b_ih + b_hh; gates i, f, g, o."""

    def __init__(self, input_size: int, hidden: int):
        super().__init__()
        scale = 1.0 / math.sqrt(hidden)
        self.Wx = mx.random.uniform(-scale, scale, (4 * hidden, input_size))
        self.Wh = mx.random.uniform(-scale, scale, (4 * hidden, hidden))
        self.bias = mx.random.uniform(-scale, scale, (4 * hidden,))

    def __call__(self, x: mx.array, h: mx.array, c: mx.array) -> tuple[mx.array, mx.array]:
        gates = ops.float32_matmul_t(x, self.Wx, self, "Wx") + ops.float32_matmul_t(h, self.Wh, self, "Wh") + self.bias
        return ops.fused(("lstm_cell_update",), lambda: _lstm_cell_update)(gates, c)


def _lstm_cell_update(gates: mx.array, c: mx.array) -> tuple[mx.array, mx.array]:
    """(h, c) from the gate pre-activations (i, f, g, o) and the previous cell state."""
    i, f, g, o = mx.split(gates, 4, axis=-1)
    c = mx.sigmoid(f) * c + mx.sigmoid(i) * mx.tanh(g)
    return mx.sigmoid(o) * mx.tanh(c), c


class _DecRnn(nn.Module):
    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.lstm = [LstmCell(hidden, hidden) for _ in range(layers)]


class _Prediction(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size + 1, hidden)  # row vocab_size = blank
        self.dec_rnn = _DecRnn(hidden, layers)


LstmState = tuple[tuple[mx.array, mx.array], ...]  # per layer (h, c), each (hidden,)


class RnntDecoder(nn.Module):
    """`rnnt_decoder.`: prediction network."""

    def __init__(self, audio_cfg: AudioConfig):
        super().__init__()
        dc = audio_cfg.decoder
        self.vocab_size = dc.vocab_size
        self.blank_id = dc.vocab_size
        self.hidden = dc.pred_hidden
        self.prediction = _Prediction(dc.vocab_size, dc.pred_hidden, dc.pred_rnn_layers)

    def initial_state(self) -> LstmState:
        z = mx.zeros((self.hidden,), dtype=mx.float32)
        return tuple((z, z) for _ in self.prediction.dec_rnn.lstm)

    def predict(self, token: int, state: LstmState | None) -> tuple[mx.array, LstmState]:
        """One prediction step: (top-layer h (hidden,), proposed state).

        The blank token (start of stream) feeds a zero vector instead of an
        embedding row; state None means zeros.
        """
        if not isinstance(token, int) or not 0 <= token <= self.blank_id:
            raise ValueError(f"RnntDecoder.predict: token must be an int in [0, {self.blank_id}], got {token!r}")
        if state is None:
            state = self.initial_state()
        if token == self.blank_id:
            x = mx.zeros((self.hidden,), dtype=mx.float32)
        else:
            # Through the module: works for a dense and a quantized (packed) embedding alike.
            x = self.prediction.embed(mx.array([token]))[0].astype(mx.float32)
        return self._layers(x, state)

    def predict_array(self, token: mx.array, state: LstmState | None) -> tuple[mx.array, LstmState]:
        """`predict` for a token held on the device (an int32 scalar, possibly not yet computed):
        the blank's input is the zero vector, selected, so the values are `predict`'s."""
        if state is None:
            state = self.initial_state()
        embedded = self.prediction.embed(token.reshape(1)).astype(mx.float32)  # (1, hidden), as the state is
        x = mx.where(token == self.blank_id, mx.zeros_like(embedded), embedded)
        return self._layers(x, state)

    def _layers(self, x: mx.array, state: LstmState) -> tuple[mx.array, LstmState]:
        new_state = []
        for cell, (h, c) in zip(self.prediction.dec_rnn.lstm, state, strict=True):
            h, c = cell(x, h, c)
            new_state.append((h, c))
            x = h
        return x, tuple(new_state)


class RnntJoint(nn.Module):
    """`rnnt_joint.`: enc (d_enc -> J), pred (pred_hidden -> J),
    joint_net = [ReLU, (dropout), Linear J -> vocab + 1]."""

    def __init__(self, audio_cfg: AudioConfig):
        super().__init__()
        jc = audio_cfg.joint
        # Widths from the config: a quantized layer's stored weight is packed (in·bits/32 columns).
        self.encoder_hidden = jc.encoder_hidden
        self.enc = nn.Linear(jc.encoder_hidden, jc.joint_hidden)
        self.pred = nn.Linear(jc.pred_hidden, jc.joint_hidden)
        self.joint_net = [nn.ReLU(), nn.Identity(), nn.Linear(jc.joint_hidden, jc.num_classes + 1)]

    def project_encoder(self, enc: mx.array) -> mx.array:
        return self.enc(enc.astype(mx.float32))

    def project_prediction(self, pred: mx.array) -> mx.array:
        return self.pred(pred)

    def logits(self, enc_proj: mx.array, pred_proj: mx.array) -> mx.array:
        """Logits from already projected encoder / prediction vectors."""
        return self.joint_net[2](nn.relu(enc_proj + pred_proj))

    def __call__(self, enc: mx.array, pred: mx.array) -> mx.array:
        return self.logits(self.project_encoder(enc), self.project_prediction(pred))


def _check_max_symbols(max_symbols) -> int:
    if not isinstance(max_symbols, int) or max_symbols < 1:
        raise ValueError(f"max_symbols must be a positive int, got {max_symbols!r}")
    return max_symbols


def _as_enc_frames(enc_frames, d: int, what: str) -> mx.array:
    if not isinstance(enc_frames, mx.array):
        raise TypeError(f"{what}: expected an mx.array (T, {d}), got {type(enc_frames).__name__}")
    if enc_frames.ndim != 2 or enc_frames.shape[1] != d:
        raise ValueError(f"{what}: expected encoder frames of shape (T, {d}), got {tuple(enc_frames.shape)}")
    return enc_frames.astype(mx.float32)


def greedy_decode(
    decoder: RnntDecoder,
    joint: RnntJoint,
    enc_frames: mx.array,
    max_symbols: int,
    skip_ids: Iterable[int] = (),
) -> list[int]:
    """Offline greedy RNNT decoding of enc_frames (T, d) -> emitted token ids.

    Per frame: run the prediction net on the last emitted token, take the
    joint's argmax; blank ends the frame, anything else is emitted (becomes the
    last token, its state is kept) up to max_symbols per frame. Ids in
    `skip_ids` (special pieces) still drive the decoder but are not returned.
    """
    _check_max_symbols(max_symbols)
    enc_frames = _as_enc_frames(enc_frames, joint.encoder_hidden, "greedy_decode")
    skip = frozenset(skip_ids)
    enc_proj = joint.project_encoder(enc_frames)  # all frames at once
    blank = decoder.blank_id
    last, state, tokens = blank, None, []
    for t in range(enc_proj.shape[0]):
        for _ in range(max_symbols):
            pred, proposed = decoder.predict(last, state)
            k = int(mx.argmax(joint.logits(enc_proj[t], joint.project_prediction(pred))).item())
            if k == blank:
                break
            last, state = k, proposed
            if k not in skip:
                tokens.append(k)
    return tokens


class RnntState:
    """Greedy-decoding state carried across encoder frames.

    last_token (int, blank at start), lstm (per-layer (h, c)), the memoised
    prediction for that input (pred_out, its projection pred_proj and the
    proposed LSTM state, or None when it must be recomputed), emitted tokens,
    and counters (frames, prediction_calls).
    """

    def __init__(self, blank_id: int):
        self.blank_id = blank_id
        self.reset()

    def reset(self) -> None:
        self.last_token = self.blank_id
        self.lstm: LstmState | None = None
        self.pred_out: mx.array | None = None
        self.pred_proj: mx.array | None = None
        self.pred_state: LstmState | None = None
        self.tokens: list[int] = []
        self.frames = 0
        self.prediction_calls = 0

    def copy(self) -> RnntState:
        other = object.__new__(RnntState)
        other.__dict__.update(self.__dict__)
        other.tokens = list(self.tokens)
        return other

    def arrays(self) -> dict[str, mx.array]:
        """The state proper: the last token and the LSTM state. (The memoised prediction is a value
        of these two, recomputed when absent, so it is not listed.)"""
        out: dict[str, mx.array] = {"last_token": mx.array(self.last_token, dtype=mx.int32)}
        if self.lstm is not None:
            for i, (h, c) in enumerate(self.lstm):
                out[f"lstm.{i}.h"], out[f"lstm.{i}.c"] = h, c
        return out


class RnntStream:
    """Frame-by-frame greedy RNNT: `step(enc_frame (d,)) -> new token ids`.

    Same decisions as `greedy_decode`; the prediction output for the current
    (last token, LSTM state) is memoised in the state, so it is computed once at
    the start and once after each emitted symbol.
    """

    def __init__(self, decoder: RnntDecoder, joint: RnntJoint, max_symbols: int, skip_ids: Iterable[int] = ()):
        self.decoder = decoder
        self.joint = joint
        self.max_symbols = _check_max_symbols(max_symbols)
        self.skip_ids = frozenset(skip_ids)
        self.state = RnntState(decoder.blank_id)

    def reset(self) -> None:
        self.state.reset()

    def _prediction(self) -> mx.array:
        st = self.state
        if st.pred_out is None:
            st.pred_out, st.pred_state = self.decoder.predict(st.last_token, st.lstm)
            st.pred_proj = self.joint.project_prediction(st.pred_out)
            st.prediction_calls += 1
        return st.pred_proj

    def step(self, enc_frame: mx.array) -> list[int]:
        d = self.joint.encoder_hidden
        if not isinstance(enc_frame, mx.array):
            raise TypeError(f"RnntStream.step: expected an mx.array ({d},), got {type(enc_frame).__name__}")
        if enc_frame.shape == (1, d):
            enc_frame = enc_frame[0]
        if enc_frame.shape != (d,):
            raise ValueError(
                f"RnntStream.step: expected one encoder frame of shape ({d},), got {tuple(enc_frame.shape)}"
            )
        st = self.state
        enc_proj = self.joint.project_encoder(enc_frame)
        new: list[int] = []
        for _ in range(self.max_symbols):
            k = int(mx.argmax(self.joint.logits(enc_proj, self._prediction())).item())
            if k == self.decoder.blank_id:
                break  # memoised prediction stays valid: its input did not change
            st.last_token, st.lstm = k, st.pred_state
            st.pred_out = st.pred_proj = st.pred_state = None
            if k not in self.skip_ids:
                new.append(k)
        st.tokens.extend(new)
        st.frames += 1
        return new

    def step_on_device(self, enc_frame: mx.array) -> mx.array:
        """`step`'s decisions as masked arithmetic: all `max_symbols` iterations run, each symbol
        after the first blank is masked out, so nothing is read on the host. Returns the
        (max_symbols,) int32 ids, emitted ones first, then -1; the state's last token and LSTM
        state follow the emitted symbols. `finish_on_device(ids)` reads the ids (once per frame,
        with whatever else the frame reads) and completes the state."""
        d = self.joint.encoder_hidden
        if not isinstance(enc_frame, mx.array) or enc_frame.reshape(-1).shape != (d,):
            raise ValueError(f"RnntStream.step_on_device: expected one encoder frame of shape ({d},)")
        st = self.state
        if not isinstance(st.last_token, int):
            raise RuntimeError("RnntStream.step_on_device: the previous frame was not finished (finish_on_device)")
        self._frame_start = (st.last_token, st.lstm)
        enc_proj = self.joint.project_encoder(enc_frame.reshape(1, d))
        last = mx.array(st.last_token, dtype=mx.int32)
        # Rows (1, hidden) inside the loop (no per-product reshapes); the state keeps (hidden,).
        lstm = st.lstm if st.lstm is not None else self.decoder.initial_state()
        flat = [a.reshape(1, -1) for pair in lstm for a in pair]
        update = ops.fused(
            ("rnnt_masked_update", self.decoder.blank_id, len(flat)),
            lambda: functools.partial(_masked_update, self.decoder.blank_id),
        )
        active = mx.array(True)
        ids = []
        for _ in range(self.max_symbols):
            pred, proposed = self.decoder.predict_array(last, tuple(zip(flat[0::2], flat[1::2], strict=True)))
            st.prediction_calls += 1
            k = mx.argmax(self.joint.logits(enc_proj, self.joint.project_prediction(pred)), axis=-1)[0]
            active, emitted, last, *flat = update(
                active, k.astype(mx.int32), last, *[a for pair in proposed for a in pair], *flat
            )
            ids.append(emitted)
        st.last_token = last
        st.lstm = tuple((h.reshape(-1), c.reshape(-1)) for h, c in zip(flat[0::2], flat[1::2], strict=True))
        st.pred_out = st.pred_proj = st.pred_state = None
        return mx.stack(ids)

    def finish_on_device(self, ids: mx.array) -> list[int]:
        """The new token ids of a `step_on_device` frame (`ids` read here); completes the state."""
        st = self.state
        emitted = [int(k) for k in ids.tolist() if k >= 0]
        if emitted:
            st.last_token = emitted[-1]
        else:  # nothing emitted: the state is the frame's start (the same values, selected)
            st.last_token, st.lstm = self._frame_start
        new = [k for k in emitted if k not in self.skip_ids]
        st.tokens.extend(new)
        st.frames += 1
        return new


def step_rows(streams: list[RnntStream], enc_frames: list[mx.array]) -> list[list[int]]:
    """`RnntStream.step` of several conversations' streams of one model (each its own last token,
    LSTM state and memoised prediction) -> each one's new token ids. Symbol by symbol in lockstep:
    the encoder projection, the prediction network of every conversation whose prediction is not
    memoised, and the joint of every conversation still emitting run over their rows together,
    and one host read per symbol serves all of them. Each conversation makes exactly the decisions
    it makes alone (row-wise arithmetic). One stream: its `step`."""
    if len(streams) == 1:
        return [streams[0].step(enc_frames[0])]
    first = streams[0]
    decoder, joint, blank = first.decoder, first.joint, first.decoder.blank_id
    enc_proj = joint.project_encoder(mx.stack([e.reshape(-1) for e in enc_frames]))
    new: list[list[int]] = [[] for _ in streams]
    active = list(range(len(streams)))
    for _ in range(first.max_symbols):
        stale = [b for b in active if streams[b].state.pred_out is None]
        if stale:
            _predict_rows(decoder, joint, [streams[b].state for b in stale])
        pred_proj = mx.stack([streams[b].state.pred_proj for b in active])
        rows = enc_proj if len(active) == len(streams) else enc_proj[mx.array(active)]
        ks = np.array(mx.argmax(joint.logits(rows, pred_proj), axis=-1)).tolist()
        still = []
        for b, k in zip(active, ks, strict=True):
            if k == blank:
                continue  # memoised prediction stays valid: its input did not change
            st = streams[b].state
            st.last_token, st.lstm = k, st.pred_state
            st.pred_out = st.pred_proj = st.pred_state = None
            if k not in streams[b].skip_ids:
                new[b].append(k)
            still.append(b)
        active = still
        if not active:
            break
    for stream, tokens in zip(streams, new, strict=True):
        stream.state.tokens.extend(tokens)
        stream.state.frames += 1
    return new


def step_rows_on_device(streams: list[RnntStream], enc_frames: list[mx.array]) -> list[mx.array]:
    """`RnntStream.step_on_device` of several conversations' streams of one model, over their rows
    together: each iteration's prediction network, joint and masked bookkeeping run once for all
    rows (each row its own last token, LSTM state and mask), so the dispatches do not grow with
    the conversations. -> each stream's (max_symbols,) ids; `finish_on_device` completes each
    stream as alone. One stream: its `step_on_device`."""
    if len(streams) == 1:
        return [streams[0].step_on_device(enc_frames[0])]
    first = streams[0]
    decoder, joint, blank = first.decoder, first.joint, first.decoder.blank_id
    d = joint.encoder_hidden
    for stream, enc in zip(streams, enc_frames, strict=True):
        if not isinstance(enc, mx.array) or enc.reshape(-1).shape != (d,):
            raise ValueError(f"step_rows_on_device: expected one encoder frame of shape ({d},) per stream")
        if not isinstance(stream.state.last_token, int):
            raise RuntimeError("step_rows_on_device: a previous frame was not finished (finish_on_device)")
    enc_proj = joint.project_encoder(mx.stack([e.reshape(-1) for e in enc_frames]))
    initial = decoder.initial_state()
    lstm = [st.state.lstm if st.state.lstm is not None else initial for st in streams]
    for stream in streams:
        stream._frame_start = (stream.state.last_token, stream.state.lstm)
    last = mx.array([st.state.last_token for st in streams], dtype=mx.int32)
    flat = [mx.stack([s[layer][i] for s in lstm]) for layer in range(len(initial)) for i in (0, 1)]
    update = ops.fused(
        ("rnnt_masked_update_rows", blank, len(flat)),
        lambda: functools.partial(_masked_update_rows, blank),
    )
    active = mx.ones((len(streams),), dtype=mx.bool_)
    ids = []
    for _ in range(first.max_symbols):
        embedded = decoder.prediction.embed(last).astype(mx.float32)  # (n, hidden)
        x = mx.where((last == blank)[:, None], mx.zeros_like(embedded), embedded)
        pred, proposed = decoder._layers(x, tuple(zip(flat[0::2], flat[1::2], strict=True)))
        k = mx.argmax(joint.logits(enc_proj, joint.project_prediction(pred)), axis=-1)
        proposed_flat = [a for pair in proposed for a in pair]
        active, emitted, last, *flat = update(active, k.astype(mx.int32), last, *proposed_flat, *flat)
        ids.append(emitted)
    for stream in streams:
        stream.state.prediction_calls += first.max_symbols
    stacked = mx.stack(ids, axis=1)  # (n, max_symbols)
    for r, stream in enumerate(streams):
        st = stream.state
        st.last_token = last[r]
        st.lstm = tuple((h[r], c[r]) for h, c in zip(flat[0::2], flat[1::2], strict=True))
        st.pred_out = st.pred_proj = st.pred_state = None
    return [stacked[r] for r in range(len(streams))]


def _masked_update_rows(blank: int, active, k, last, *arrays):
    """`_masked_update` over rows: active, k and last (n,), the LSTM state halves (n, hidden)."""
    active = active & (k != blank)
    n = len(arrays) // 2
    keep = active[:, None]
    state = [mx.where(keep, proposed, current) for proposed, current in zip(arrays[:n], arrays[n:], strict=True)]
    return (active, mx.where(active, k, -1), mx.where(active, k, last), *state)


def _predict_rows(decoder: RnntDecoder, joint: RnntJoint, states: list[RnntState]) -> None:
    """The memoised prediction of each state (`RnntStream._prediction`), computed over their rows together."""
    tokens = [st.last_token for st in states]
    embedded = decoder.prediction.embed(mx.array(tokens)).astype(mx.float32)  # (n, hidden)
    is_blank = mx.array([t == decoder.blank_id for t in tokens])[:, None]
    x = mx.where(is_blank, mx.zeros_like(embedded), embedded)  # the blank feeds a zero vector
    initial = decoder.initial_state()
    lstm = [st.lstm if st.lstm is not None else initial for st in states]
    stacked = tuple(
        (mx.stack([s[layer][0] for s in lstm]), mx.stack([s[layer][1] for s in lstm])) for layer in range(len(initial))
    )
    pred, proposed = decoder._layers(x, stacked)
    proj = joint.project_prediction(pred)
    for r, st in enumerate(states):
        st.pred_out, st.pred_proj = pred[r], proj[r]
        st.pred_state = tuple((h[r], c[r]) for h, c in proposed)
        st.prediction_calls += 1


def _masked_update(blank: int, active, k, last, *arrays):
    """One masked greedy iteration's bookkeeping: a symbol counts while no blank came before it;
    a counted symbol becomes the last token and its proposed LSTM state (the first half of
    `arrays`) replaces the current one (the second half). -> (active, id or -1, last, state...)."""
    active = active & (k != blank)
    n = len(arrays) // 2
    state = [mx.where(active, proposed, current) for proposed, current in zip(arrays[:n], arrays[n:], strict=True)]
    return (active, mx.where(active, k, -1), mx.where(active, k, last), *state)


# --------------------------------------------------------------------------- text

_LANG_TAG = re.compile(r"^<[a-z]{2,3}-[A-Za-z]{2,4}>$")
_SPECIAL_PIECES = frozenset({"<unk>", "<pad>", "<s>", "</s>"})


def is_special_piece(piece: str) -> bool:
    return piece in _SPECIAL_PIECES or bool(_LANG_TAG.match(piece))


class RnntText:
    """RNNT vocabulary (list of SentencePiece pieces) -> text (docs/model.md §6.5)."""

    def __init__(self, vocabulary: Sequence[str]):
        if isinstance(vocabulary, str) or not all(isinstance(p, str) for p in vocabulary):
            raise TypeError("RnntText: vocabulary must be a list of piece strings")
        self.vocabulary = list(vocabulary)
        self.special_ids = frozenset(i for i, p in enumerate(self.vocabulary) if is_special_piece(p))

    def piece_text(self, token: int) -> str:
        """Text of one id: '' for specials and out-of-range ids, '▁' -> ' '."""
        if not 0 <= token < len(self.vocabulary) or token in self.special_ids:
            return ""
        return self.vocabulary[token].replace("▁", " ")

    def decode(self, tokens: Iterable[int]) -> str:
        return "".join(self.piece_text(int(t)) for t in tokens).strip()


class RnntTranscript:
    """Incremental transcript: `add(tokens) -> (delta, text)` without re-decoding history.

    Keeps the concatenated text with its leading whitespace removed; the
    transcript is that string right-stripped, so it always extends the previous
    transcript and the delta is the new suffix ('' when nothing visible changed).
    """

    def __init__(self, text: RnntText):
        self.decoder = text
        self.reset()

    def reset(self) -> None:
        self._body = ""  # decoded text so far, left-stripped, not right-stripped
        self.text = ""

    def copy(self) -> RnntTranscript:
        other = object.__new__(RnntTranscript)
        other.__dict__.update(self.__dict__)
        return other

    def add(self, tokens: Iterable[int]) -> tuple[str, str]:
        piece = "".join(self.decoder.piece_text(int(t)) for t in tokens)
        if not piece:
            return "", self.text
        self._body = (self._body + piece) if self._body else piece.lstrip()
        new = self._body.rstrip()
        previous = self.text
        self.text = new
        delta = new[len(previous) :] if new.startswith(previous) else new
        return delta, new


__all__ = [
    "LstmCell",
    "RnntDecoder",
    "RnntJoint",
    "greedy_decode",
    "RnntState",
    "RnntStream",
    "RnntText",
    "RnntTranscript",
    "is_special_piece",
]
