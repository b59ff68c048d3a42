"""EAR-TTS codes: this project (default numerics) vs the reference (mlx-vlm), frame for frame
(`-m peers`, needs the peers extra).

issue 4 / issue 15: with default arguments the ids, function ids and all codes equal
the reference's for the same checkpoint, input and seed, on every frame, offline
and streamed, with and without a system prompt. The default `numerics="reference"`
rounds EAR-TTS as the reference does (voicechat/model/tts/numerics.py); `numerics="float32"`
is the float32 option, whose codes differ (the power check). One frame is apart: the
reference's offline frame 0 without a prompt is an all-zero row (§12.2 item 7, a bug of
its own); ours is the silence row, as both streams have.

Codes are compared exactly (argmax / argmin decisions; with the reference's roundings
both implementations compute bit-identical backbone hidden states and MoG residuals):
the raw codes (what EAR-TTS generated, fed back to the next step) and the decoded codes
(after control-code replacement: `OfflineResult.audio_codes`, the `Audio` events).

Checkpoints: the tiny bf16, 4-bit and 8-bit synthetic ones with the shared
question.wav, and one in the published layout (language path 4-bit, bf16 elsewhere)
with 31 codebooks of 64 codes whose three control codes lie inside the generated range,
top_p 1e-6 and noise 0 (no random draw matters), and a byte-level BPE tokenizer trained
with `tokenizers` (not the project's hand-built one), on long_question.wav (106 frames,
past the 70-frame conformer window).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
pytestmark = pytest.mark.peers

from harness.backends import get_backend  # noqa: E402
from harness.backends.voicechat_backend import VoiceChatBackend  # noqa: E402

PROMPT = "hello"
LONG_PROMPT = "You are a helpful voice assistant. Please tell me a story about a small cat."
BITS = {"bf16": None, "4bit": 4, "8bit": 8, "greedy31x64": 4}
_CORPUS = (
    "hello world how are you today the weather is fine thank you very much what time is it please "
    "tell me a story about a small cat and a big dog who lived in a house near the river voice chat "
    "model speech audio text question answer assistant user good morning evening helpful"
)


def _trained_bpe(folder, vocab_size: int) -> None:
    """Replace the checkpoint's tokenizer by a byte-level BPE trained on a small corpus (ids 0..19 the
    published specials, then whatever order the trainer gives the 256 byte characters and merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 20)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = np.random.default_rng(7)
    words = _CORPUS.split()
    tok.train_from_iterator([" ".join(rng.choice(words, size=10)) for _ in range(300)], trainer=trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have < vocab_size:
        tok.add_tokens([f"filler{i:03d}" for i in range(vocab_size - have)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert sum(1 for t in tok.get_vocab(with_added_tokens=True) if len(t) == 1) == 256
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def greedy_ckpt(tmp_path_factory):
    from voicechat.synthetic.checkpoint import write_checkpoint

    folder = write_checkpoint(
        tmp_path_factory.mktemp("greedy31x64"),
        "tiny",
        bits=4,
        overrides={
            "tts_config": {"num_quantizers": 31, "codebook_size": 64, "top_p": 1e-6, "noise_scale": 0.0},
            "codec_config": {"num_quantizers": 31, "codebook_size": 64},
        },
    )
    _trained_bpe(folder, 512)
    return folder


@pytest.fixture(scope="module", params=list(BITS))
def runs(request, tiny_ckpt, tiny_ckpt_4bit, tiny_ckpt_8bit, greedy_ckpt, question_wav, long_question_wav):
    """{prompt key: (ours offline, ours stream, reference offline, reference stream)} per checkpoint,
    plus the models' silence and control codes."""
    path = {"bf16": tiny_ckpt, "4bit": tiny_ckpt_4bit, "8bit": tiny_ckpt_8bit, "greedy31x64": greedy_ckpt}[
        request.param
    ]
    audio = long_question_wav if request.param == "greedy31x64" else question_wav
    prompts = (("prompt", PROMPT), ("none", None))
    if request.param == "greedy31x64":
        prompts += (("long prompt", LONG_PROMPT),)
    vlm = get_backend("mlx-vlm")
    vlm.load(str(path))
    ours = VoiceChatBackend()
    ours.load(str(path))
    assert ours.model.numerics.name == "reference"  # the default
    out = {"name": request.param, "keys": [k for k, _ in prompts]}
    try:
        for key, prompt in prompts:
            out[key] = (
                ours.offline(audio, system_prompt=prompt),
                ours.stream(audio, system_prompt=prompt),
                vlm.offline(audio, system_prompt=prompt),
                vlm.stream(audio, system_prompt=prompt),
            )
        tts = ours.model.tts_model
        out["silence"] = np.array(tts.codec_silence_tokens).astype(np.int32)
        out["control"] = np.array(tts.control_codes).astype(np.int32)
        if request.param in ("4bit", "greedy31x64"):
            # The float32 option's codes do move (power of the comparison).
            f32 = VoiceChatBackend(numerics="float32")
            f32.load(str(path))
            out["float32"] = f32.offline(audio, system_prompt=PROMPT)
            f32.close()
    finally:
        vlm.close()
        ours.close()
    return out


def _differing_frames(a: np.ndarray, b: np.ndarray) -> list[int]:
    assert a.shape == b.shape and a.dtype == b.dtype == np.int32
    return [i for i in range(a.shape[0]) if not np.array_equal(a[i], b[i])]


def _keys(runs):
    return runs["keys"]


def test_language_path_agrees(runs):
    """The TTS consumes the text ids: they must agree first (the codes test is meaningless otherwise)."""
    for key in _keys(runs):
        vo, vs, mo, ms = runs[key]
        for a, b in ((vo, mo), (vs, ms)):
            np.testing.assert_array_equal(a.text_ids, b.text_ids)
            np.testing.assert_array_equal(a.function_ids, b.function_ids)


def test_streamed_codes_equal_reference_on_every_frame(runs):
    for key in _keys(runs):
        _, vs, _, ms = runs[key]
        assert vs.codes.shape == ms.codes.shape and vs.codes.shape[0] >= 20
        assert _differing_frames(vs.codes, ms.codes) == [], key
        assert _differing_frames(vs.decoded_codes, ms.decoded_codes) == [], key


def test_offline_codes_equal_reference_on_every_frame(runs):
    """Every frame, except offline frame 0 without a prompt: the reference's all-zero row there,
    ours the silence row (= both streams' frame 0)."""
    for key in _keys(runs):
        vo, vs, mo, _ = runs[key]
        assert vo.codes.shape == mo.codes.shape and vo.codes.shape[0] >= 20
        first = 0
        if key == "none":
            assert not mo.codes[0].any() and vo.codes[0].any(), key
            np.testing.assert_array_equal(vo.codes[0], vs.codes[0])
            first = 1
        assert _differing_frames(vo.codes[first:], mo.codes[first:]) == [], key
        assert _differing_frames(vo.decoded_codes[first:], mo.decoded_codes[first:]) == [], key


def test_decoded_codes_are_the_raw_codes_with_control_codes_replaced(runs):
    """The reference's result / audio events carry the replaced codes; so do ours (`decoded_codes`
    come from OfflineResult.audio_codes and the Audio events)."""
    silence, control = runs["silence"], runs["control"]
    replaced_somewhere = False
    for key in _keys(runs):
        for run in runs[key]:
            is_control = np.isin(run.codes, control)
            np.testing.assert_array_equal(run.decoded_codes, np.where(is_control, silence[None, :], run.codes))
            replaced_somewhere |= bool(is_control.any())
    assert replaced_somewhere  # control codes lie inside the generated range: the check has power


def test_codes_are_not_trivially_equal(runs):
    """The comparison has power: codes vary over frames and codebooks, and the float32 option gives
    different codes."""
    _vo, _, mo, _ = runs["prompt"]
    assert len({tuple(r) for r in mo.codes.tolist()}) > mo.codes.shape[0] // 2
    assert len(set(mo.codes.ravel().tolist())) > 8
    if "float32" in runs:
        assert len(_differing_frames(runs["float32"].codes, mo.codes)) > 0


def test_speaker_warmup_is_computed_under_the_models_numerics(greedy_ckpt):
    """The speaker warm-up (made once per model, at load) is the reference's, K/V bit for bit, on
    every TTS layer: it is computed under the model's own numerics. With the former process-wide
    switch, a model loaded (and warmed up) in float32 then run under the reference's roundings kept
    its float32 warm-up, and its codes drifted from the reference's after a few frames (measured on
    long_question.wav with the independent writer's real-depth 31 x 64 greedy 4-bit checkpoint: from
    frame 3 without a prompt, 84 of 106 frames differing). The float32 warm-up does differ."""
    import mlx.core as mx

    import voicechat

    vlm = get_backend("mlx-vlm")
    vlm.load(str(greedy_ckpt))
    try:
        sess = vlm.session
        prompt = sess._tts_prompt()
        _, cache = vlm.model.tts_model.tts_model.warmup(*prompt[:-1], audio_prompt_latent=prompt[-1], guidance=True)
        theirs = [tuple(np.array(t.astype(mx.float32)) for t in c.state) for c in cache]
    finally:
        vlm.close()
    for numerics, equal in (("reference", True), ("float32", False)):
        model = voicechat.load(greedy_ckpt, numerics=numerics)
        state = model.warm_tts_state()
        same = True
        for i, (k_ref, v_ref) in enumerate(theirs):
            k, v = (np.array(a) for a in state.ordered_kv(i))
            n = k.shape[2]  # a sliding layer keeps its last `window` positions
            assert k.shape == k_ref[:, :, -n:].shape
            same &= np.array_equal(k, k_ref[:, :, -n:]) and np.array_equal(v, v_ref[:, :, -n:])
        assert same == equal, numerics
