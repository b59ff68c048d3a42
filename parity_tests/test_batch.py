"""Many sessions in one process (api.md; voicechat/streaming/batch.py): every session of a batch
computes exactly what it computes alone.

Sessions of different prompts (one from a prompt state), seeds, push sizes, tools with a scheduled
tool result, joining and leaving at different frames and one reaching its length limit share the
ticks of one batch; each one's events (ids, texts, transcripts, tool events, codes and audio
samples, every byte) equal the same session run alone. The checkpoints' heads and codebooks have
near-ties (parity_tests/test_near_ties.py), so a one-ulp difference in any row shows up as a changed
id or code: `test_a_one_ulp_difference_in_one_row_is_caught` proves this comparison sees one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

import voicechat
from parity_tests.conftest import TIME_TOOL, TOOLCALL_ARGUMENTS, TOOLCALL_TOOL
from voicechat.errors import BatchFullError, ContextLimitError, SessionClosedError
from voicechat.events import ToolCall
from voicechat.runtime.policy import ExecutionPolicy

# On a CPU device every batched row is computed with its solo arithmetic: everything is compared bit
# for bit. On Metal MLX sums one row and several rows in other orders (docs/voicechat.md, "Many
# sessions in one process"): there the integer results (ids, codes, tokens, event kinds) are compared
# exactly and float arrays by shape only.
EXACT = mx.default_device() == mx.cpu


def _value(v):
    if isinstance(v, np.ndarray):
        if EXACT or not np.issubdtype(v.dtype, np.floating):
            return (str(v.dtype), v.shape, v.tobytes())
        return (str(v.dtype), v.shape)
    return repr(v)


def digest(events) -> list:
    """Every field of every event (or frame record); arrays by dtype, shape and bytes (bit for bit)."""
    return [(type(e).__name__, {f.name: _value(getattr(e, f.name)) for f in dataclasses.fields(e)}) for e in events]


@dataclass
class Plan:
    """One conversation: how it opens, its audio in chunks, when it joins, how it ends."""

    kwargs: dict
    chunks: list
    join: int = 0  # the round of the batch in which it opens
    end: str = "flush"  # "flush" | "cancel" | "limit" (max_streaming_seconds reached)
    tool_output: object = None  # answered to each ToolCall right after the push that produced it
    events: list = field(default_factory=list)


def chunks_of(audio: np.ndarray, push: int, frames: int) -> list:
    audio = audio[: frames * 1280 + 500]
    return [audio[i : i + push] for i in range(0, len(audio), push)]


def _answer(session, plan: Plan, events) -> None:
    for e in events:
        if isinstance(e, ToolCall):
            session.submit_tool_result(e.call_id, plan.tool_output)


def observed(kwargs: dict) -> tuple[dict, list]:
    """kwargs with an `on_frame` that keeps each frame's record (logits, encoder frame, mel, ids, codes)."""
    records: list = []
    return {**kwargs, "on_frame": records.append}, records


def finished(events: list, records: list, session) -> list:
    """What a run is compared by: every event, every frame record (the logits catch a one-ulp change of
    a row before any id flips), and the final state of every cache family."""
    limit = bool(events) and events[-1] == "limit"
    out = digest(events[:-1] if limit else events) + digest(records)
    out += [(k, _value(np.array(v))) for k, v in sorted(session.states().items())]
    return [*out, "limit"] if limit else out


def run_alone(model, plan: Plan) -> list:
    kwargs, records = observed(plan.kwargs)
    s = model.create_streaming_session(**kwargs)
    events: list = []
    for chunk in plan.chunks:
        try:
            got = s.push_audio(chunk)
        except ContextLimitError as err:
            return finished([*events, *err.events, "limit"], records, s)
        events += got
        _answer(s, plan, got)
    events += s.cancel() if plan.end == "cancel" else s.flush()
    return finished(events, records, s)


def run_batched(model, plans: list[Plan], max_sessions: int) -> list[list]:
    """Round r: the plans joining at r open; every open session's r-th chunk (counted from its join)
    goes in one `batch.push`; a session out of chunks ends."""
    batch = model.create_session_batch(max_sessions=max_sessions)
    sessions: dict[int, object] = {}
    records: dict[int, list] = {}
    results: dict[int, list] = {i: [] for i in range(len(plans))}
    ended: set[int] = set()
    rounds = max(p.join + len(p.chunks) for p in plans) + 1
    for r in range(rounds):
        for i, p in enumerate(plans):
            if p.join == r:
                kwargs, records[i] = observed(p.kwargs)
                sessions[i] = batch.open(**kwargs)
        chunks = {}
        for i, s in sessions.items():
            k = r - plans[i].join
            if i not in ended and k < len(plans[i].chunks):
                chunks[s] = plans[i].chunks[k]
        by_session: dict = {}
        if chunks:
            try:
                by_session = batch.push(chunks)
            except ContextLimitError as err:
                by_session = err.events
                for s in err.sessions:
                    i = next(j for j, t in sessions.items() if t is s)
                    results[i] += by_session.get(s, [])
                    results[i].append("limit")
                    ended.add(i)
        for i, s in sessions.items():
            if i in ended or s not in by_session:
                continue
            results[i] += by_session[s]
            _answer(s, plans[i], by_session[s])
        for i, s in sessions.items():  # out of chunks: end it (frees its slot for a later plan)
            if i not in ended and r - plans[i].join == len(plans[i].chunks) - 1:
                results[i] += s.cancel() if plans[i].end == "cancel" else s.flush()
                ended.add(i)
    return [finished(results[i], records[i], sessions[i]) for i in range(len(plans))]


def mixed_plans(model, audio, frames: int) -> list[Plan]:
    state = model.prepare_prompt("Tell me a story about a cat.", seed=5)
    return [
        Plan({"system_prompt": "hello there", "seed": 1}, chunks_of(audio, 1280, frames)),
        Plan({"prompt_state": state}, chunks_of(audio[640:], 1000, frames - 2), join=2),
        Plan({"system_prompt": None, "seed": 7}, chunks_of(audio[3000:], 3000, frames - 4), end="cancel"),
        # Joins in the slot the cancelled one frees, and stops at its length limit mid-push.
        Plan(
            {"system_prompt": "a b c", "seed": 3, "max_streaming_seconds": 0.08 * (frames // 2)},
            chunks_of(audio[100:], 2200, frames),
            join=frames // 2,
            end="limit",
        ),
    ]


def check_batch_equals_alone(model, plans, max_sessions):
    want = [run_alone(model, p) for p in plans]
    got = run_batched(model, plans, max_sessions)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w), (i, len(g), len(w))
        for j, (a, b) in enumerate(zip(g, w, strict=True)):
            assert a == b, f"session {i}, event {j}: {a!s:.300} != {b!s:.300}"
    return want


# --------------------------------------------------------------------------- the tiny checkpoints


@pytest.fixture(scope="module", params=["bf16", "4bit", "8bit"])
def tiny_models(request, tiny_ckpt, tiny_ckpt_4bit, tiny_ckpt_8bit):
    path = {"bf16": tiny_ckpt, "4bit": tiny_ckpt_4bit, "8bit": tiny_ckpt_8bit}[request.param]
    return voicechat.load(path)


def test_tiny_sessions_in_a_batch_equal_their_solo_runs(tiny_models, question_wav):
    want = check_batch_equals_alone(tiny_models, mixed_plans(tiny_models, question_wav, 12), max_sessions=3)
    assert want[3][-1] == "limit"  # the limit was reached inside a batched push
    assert any(e[0] == "Cancelled" for e in want[2])


def test_tool_sessions_in_a_batch_equal_their_solo_runs(toolcall_model, question_wav):
    """Two sessions with tools (different result values, different push sizes) and one without, on the
    toolcall preset: the calls, the forced responses and what follows equal each one's solo run."""
    from voicechat.synthetic.toolcall import ToolcallScript

    n = len(ToolcallScript(toolcall_model.tokenizer._tok, TOOLCALL_TOOL, TOOLCALL_ARGUMENTS).script)
    wave = np.concatenate([question_wav, np.zeros(1280 * (n + 110), np.float32)])  # the call comes at frame n
    plans = [
        Plan({"tools": [TIME_TOOL], "seed": 0}, chunks_of(wave, 1280, n + 100), tool_output="12:00 UTC"),
        Plan({"seed": 2}, chunks_of(wave[1000:], 1700, n + 10), join=1),
        Plan(
            {"tools": [TIME_TOOL], "seed": 4},
            chunks_of(wave[300:], 2560, n + 100),
            join=3,
            tool_output={"time": "09:30", "timezone": TOOLCALL_ARGUMENTS["timezone"]},
        ),
    ]
    want = check_batch_equals_alone(toolcall_model, plans, max_sessions=3)
    for i in (0, 2):  # the tool round trip really happened inside the batch
        kinds = [e[0] for e in want[i]]
        assert "ToolCall" in kinds and "ToolResultDone" in kinds, (i, sorted(set(kinds))[5:])


def test_gpu_policy_batch_equals_its_solo_runs(tiny_ckpt_4bit, question_wav):
    """The GPU policy runs MLX's own kernels (here on the CPU device): ids, codes and audio of each
    batched session equal its solo run under that policy."""
    model = voicechat.load(tiny_ckpt_4bit, policy=ExecutionPolicy.gpu())
    check_batch_equals_alone(model, mixed_plans(model, question_wav, 8)[:3], max_sessions=3)


# --------------------------------------------------------------------------- the real geometry


@pytest.fixture(scope="module", params=[4, 8])
def small16(request, tmp_path_factory):
    """small16: the published layout at the real depth (56 layers) and 31 codebooks."""
    from voicechat.io.tokenizer import write_synthetic_tokenizer
    from voicechat.synthetic.checkpoint import write_checkpoint
    from voicechat.synthetic.toolcall import SPECIAL_COUNT

    path = write_checkpoint(
        tmp_path_factory.mktemp(f"batch_small16_{request.param}bit"), "small16", bits=request.param, progress=False
    )
    write_synthetic_tokenizer(path, 8192, SPECIAL_COUNT)  # the function channel's markers: takes tools
    m = voicechat.load(path)
    assert m.config.codec_config.num_quantizers == 31 and m.config.text_config.num_hidden_layers == 56
    return m


def test_small16_sessions_in_a_batch_equal_their_solo_runs(small16, question_wav):
    plans = mixed_plans(small16, question_wav, 10)
    plans[0].kwargs["tools"] = [TIME_TOOL]  # the tools block in one prompt (random weights: no call expected)
    check_batch_equals_alone(small16, plans, max_sessions=3)


@pytest.mark.parametrize("bits,policy", [(4, None), (None, None), (4, "gpu")], ids=["4bit", "bf16", "4bit-gpu-policy"])
def test_independent_real_depth_sessions_in_a_batch_equal_their_solo_runs(tmp_path_factory, question_wav, bits, policy):
    """The independent writer's real-depth checkpoint (published layout, 4-bit and bf16; not this
    project's writer); and under the GPU policy (MLX's own kernels, the RNNT on the device, the codec
    over all conversations' rows), here on the CPU device."""
    from .independent_writer import Spec, write

    path = write(tmp_path_factory.mktemp("batch_independent"), Spec(depth="real", bits=bits))
    model = voicechat.load(path, policy=ExecutionPolicy.gpu() if policy == "gpu" else None)
    check_batch_equals_alone(model, mixed_plans(model, question_wav, 8), max_sessions=4)


def test_a_one_ulp_difference_in_one_row_is_caught(small16, question_wav, monkeypatch):
    """The comparison above sees a one-ulp change: nudge one row of the batched language step's
    hidden state by one ulp (what a product summing that row in another order would do) and the
    batched session no longer equals its solo run."""
    from voicechat.model.llm import nemotron_h

    original = nemotron_h.NemotronH.step_batch

    def nudged(self, x, states):
        out = original(self, x, states)
        if out.shape[0] < 2:
            return out
        row = np.array(out[1:2])
        row = np.nextafter(row, np.float32(np.inf), dtype=np.float32)
        return mx.concatenate([out[:1], mx.array(row), out[2:]], axis=0)

    plans = mixed_plans(small16, question_wav, 10)[:3]
    want = [run_alone(small16, p) for p in plans]
    if not EXACT:
        pytest.skip("on Metal float arrays are compared by shape (see EXACT)")
    monkeypatch.setattr(nemotron_h.NemotronH, "step_batch", nudged)
    got = run_batched(small16, plans, 3)
    assert any(g != w for g, w in zip(got, want, strict=True))


# --------------------------------------------------------------------------- the batch's contract


def test_a_bad_chunk_raises_and_changes_no_session(tiny_model_4bit, question_wav):
    model = tiny_model_4bit
    batch = model.create_session_batch(max_sessions=2)
    a, b = batch.open(seed=1), batch.open(seed=2)
    batch.push({a: question_wav[:2000], b: question_wav[:700]})
    before = [(s.frame_index, s.pending_samples, {k: np.array(v) for k, v in s.states().items()}) for s in (a, b)]
    for bad in (np.full(1280, np.nan, dtype=np.float32), np.zeros((2, 2, 2), np.float32), "noise"):
        with pytest.raises((ValueError, TypeError)):
            batch.push({a: question_wav[2000:4000], b: bad})
    with pytest.raises(ValueError, match="16000"):
        batch.push({a: question_wav[2000:4000]}, sample_rate=24000)
    other = model.create_session_batch(max_sessions=1).open()
    with pytest.raises(ValueError, match="not a session of this batch"):
        batch.push({a: question_wav[2000:4000], other: question_wav[:100]})
    for s, (frames, pending, states) in zip((a, b), before, strict=True):
        assert s.frame_index == frames and s.pending_samples == pending
        assert all(np.array_equal(np.array(v), states[k]) for k, v in s.states().items())
    # ... and the sessions go on exactly as their solo runs.
    solo = model.create_streaming_session(seed=1)
    want = digest(solo.push_audio(question_wav[:2000]) + solo.push_audio(question_wav[2000:4000]) + solo.flush())
    got = batch.push({a: question_wav[2000:4000]})[a] + a.flush()
    first = model.create_streaming_session(seed=1).push_audio(question_wav[:2000])
    assert digest(first) + digest(got) == want


def test_slots_fill_refuse_and_free(tiny_model_4bit, question_wav):
    batch = tiny_model_4bit.create_session_batch(max_sessions=2)
    assert batch.max_sessions == 2 and batch.sessions == []
    a = batch.open(seed=1)
    b = batch.open(seed=2)
    with pytest.raises(BatchFullError, match="2 slots"):
        batch.open(seed=3)
    assert batch.sessions == [a, b]
    a.cancel()
    assert batch.sessions == [b]
    c = batch.open(seed=3)
    assert batch.sessions == [c, b] and c.slot == 0
    b.flush()
    with pytest.raises(SessionClosedError):
        b.push_audio(question_wav[:1280])
    with pytest.raises(SessionClosedError):
        batch.push({b: question_wav[:1280]})
    assert batch.sessions == [c]
    with pytest.raises(ValueError, match="max_sessions"):
        tiny_model_4bit.create_session_batch(max_sessions=0)
    # A session that fails to open (a bad argument) takes no slot.
    with pytest.raises(ValueError, match="max_streaming_seconds"):
        batch.open(max_streaming_seconds=-1)
    assert batch.sessions == [c] and batch.free_slots == 1


def test_a_batched_sessions_own_methods_are_its_solo_methods(tiny_model_4bit, question_wav):
    """push_audio / push_frames / flush on a batched session (a batch of one each call) give its solo run."""
    model = tiny_model_4bit
    plan = chunks_of(question_wav, 1900, 9)
    solo = model.create_streaming_session(seed=6, profile=True)
    want = []
    for c in plan:
        want += solo.push_audio(c)
    want += solo.flush()
    batch = model.create_session_batch(max_sessions=2)
    other = batch.open(seed=9)
    s = batch.open(seed=6, profile=True)
    got = []
    for k, c in enumerate(plan):
        if k % 2:
            got += s.push_audio(c)
        else:
            for frame in s.push_frames(c):
                got += frame
        batch.push({other: c[:300]})
    got += s.flush()
    assert digest(got) == digest(want)
    assert len(s.profile.frames) == len(solo.profile.frames) == s.frame_index


def test_a_tts_state_in_a_block_is_copied_and_measured_where_it_is(tiny_ckpt_4bit, question_wav):
    """While batched, a conversation's TTS K/V are a row pair of the tick's block. A copy taken then
    keeps that moment's values while the block moves on; `nbytes` reports the state's own buffers
    without taking it out of the block; the next tick over the same sessions reuses the block."""
    model = voicechat.load(tiny_ckpt_4bit)
    wave = np.asarray(question_wav, dtype=np.float32)
    n = model.config.frame_samples
    batch = model.create_session_batch(max_sessions=2)
    a, b = batch.open(seed=1), batch.open(seed=2)
    batch.push({a: wave[: 3 * n], b: wave[: 3 * n]})
    tts = a.state.timeline.state.tts
    block = tts.block
    assert block is not None and tts.row_of(block) == 0
    measured = tts.nbytes
    snap = tts.copy()
    assert tts.block is block  # neither the copy nor nbytes took it out
    batch.push({a: wave[3 * n : 5 * n], b: wave[3 * n : 5 * n]})
    assert tts.block is block and tts.row_of(block) == 0 and tts.offset == snap.offset + 2
    # the copy is the state after 3 frames, whole buffers included: a solo session's after 3 frames
    solo = model.create_streaming_session(seed=1)
    solo.push_audio(wave[: 3 * n])
    want = solo.state.timeline.state.tts.state
    got = snap.state
    assert sorted(got) == sorted(want)
    for key in want:
        assert np.array(got[key]).tobytes() == np.array(want[key]).tobytes(), key
    now = tts.nbytes
    own = sum(k.nbytes for k in tts.keys) + sum(v.nbytes for v in tts.values) + tts.previous_codes.nbytes
    assert tts.block is None and now == own  # reading its buffers cut them out; nbytes said the same before
    assert measured <= now


def test_growing_caches_stay_in_their_block_across_ticks_of_any_subset(tiny_ckpt_4bit, question_wav):
    """The TTS and language K/V blocks are made once for the sessions that tick together and kept
    when only some of them tick (the others are padding rows: nothing of theirs is copied or
    changed); a session that closes leaves with its own copy and frees its row; one joining takes
    the freed row (only its own buffers are copied). Every session still equals its solo run."""
    from voicechat.model.llm.nemotron_h import AttentionLayerState

    model = voicechat.load(tiny_ckpt_4bit)
    wave = np.asarray(question_wav, dtype=np.float32)
    n = model.config.frame_samples

    def blocks(session):
        ts = session.state.timeline.state
        attn = [layer for layer in ts.llm.layers if isinstance(layer, AttentionLayerState)]
        assert attn, "the tiny checkpoint has attention layers"
        return ts.tts.block, attn[0].block

    batch = model.create_session_batch(max_sessions=3)
    a, b, c = batch.open(seed=1), batch.open(seed=2), batch.open(seed=3)
    got = {s: [] for s in (a, b, c)}
    for s, ev in batch.push({a: wave[: 2 * n], b: wave[: 2 * n], c: wave[: 2 * n]}).items():
        got[s] += ev
    first = blocks(a)
    assert all(x is not None for x in first) and blocks(b) == first and blocks(c) == first
    for t in range(2, 5):  # only a and c tick
        for s, ev in batch.push({a: wave[t * n : (t + 1) * n], c: wave[t * n : (t + 1) * n]}).items():
            got[s] += ev
    assert blocks(a) == first and blocks(b) == first and blocks(c) == first
    for s, ev in batch.push({b: wave[2 * n : 5 * n]}).items():  # b alone catches up, still in the block
        got[s] += ev
    assert blocks(b) == first
    got[c] += c.cancel()  # leaves: its own copy, its row free
    tts_block, attn_block = first
    assert blocks(c) == (None, None) and tts_block.members[2] is None and attn_block.members[2] is None
    d = batch.open(seed=4)
    got[d] = []
    for s, ev in batch.push({a: wave[5 * n : 7 * n], b: wave[5 * n : 7 * n], d: wave[: 2 * n]}).items():
        got[s] += ev  # d's first frame takes no TTS step (position 0): it joins the blocks at its second
    # d took c's freed row: the same blocks, nothing of a's or b's copied
    assert blocks(d) == first and blocks(a) == first and tts_block.members[2] is d.state.timeline.state.tts
    for s, seed, stop, end in ((a, 1, 7, None), (b, 2, 7, None), (c, 3, 5, "cancel"), (d, 4, 2, None)):
        solo = model.create_streaming_session(seed=seed)
        want = solo.push_audio(wave[: stop * n])
        if end == "cancel":
            want += solo.cancel()
        assert [repr(e) for e in got[s]] == [repr(e) for e in want], seed
        if end is None:
            mine, theirs = s.states(), solo.states()
            assert sorted(mine) == sorted(theirs)
            for key in theirs:
                assert np.array(mine[key]).tobytes() == np.array(theirs[key]).tobytes(), (seed, key)
