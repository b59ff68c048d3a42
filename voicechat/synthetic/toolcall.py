"""The `toolcall` synthetic preset: random weights, except a language path built to call one tool.

Random weights never emit SOTC, so this preset makes the whole tool loop run through the real code
(prefill with the tools block, the call, the forced response, EOTR, speech). The language path is
built so that its output follows a script:

* every layer's output projection (Mamba `out_proj`, attention `o_proj`, MLP `down_proj`) and the
  perception projection are zero, so the final hidden state is RMSNorm(E(prev_text) + w_f *
  E(prev_function)): the residual stream carries the fused input embedding unchanged;
* the embedding gives each token that steers the script its own unit direction (all other rows are
  zero), and both heads score a token by which directions are present. Per frame, with the
  previous text id as a counter:

      (PAD, PAD)      -> text T_0,       function PAD       the first audio frame
      (T_k, any)      -> text T_{k+1},   function script[k] spells SOTC, the call's tokens, EOTC
      (T_{n-1}, any)  -> text SILENCE,   function EOTC
      (SILENCE, any)  -> text SILENCE,   function PAD       waiting for the result
      (PAD, '>')      -> text S_0,       function EOTR      the last forced token of </TOOL_RESPONSE>
      (S_k, any)      -> text S_{k+1},   function PAD       a few words, then SILENCE (idle)

  Scores are 4 for the counter's own direction, 1 for the weaker rules (and doubled for the
  function channel's input by w_f = 2), so every decision has a margin of at least 2x, far above
  what 4-bit quantization of these small integers changes (< 7 %).

The text ids T_k / S_k are distinct tokens; the width of the language path is the number of
directions needed, rounded up to a multiple of 64 (the published layout quantizes it).
"""

from __future__ import annotations

import json

import numpy as np

from voicechat.tools.channel import MARKER_IDS, TOOL_NAME

SPEECH_WORDS = 4
MAX_SCRIPT = 99  # SOTC at frame 1, so EOTC within the first 100 audio frames (api.md)
SPECIAL_COUNT = 32  # <SPECIAL_0..31> in the tokenizer (the markers are 20-22)


def call_text(name: str, arguments) -> str:
    """`<TOOLCALL>[{"name": NAME, "arguments": ARGS}]</TOOLCALL>` as the model writes it."""
    return "<TOOLCALL>" + json.dumps([{"name": name, "arguments": arguments}]) + "</TOOLCALL>"


def parse_arguments(arguments) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"--arguments must be a JSON object, got {arguments!r} ({e})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the tool call's arguments must be a JSON object, got {type(arguments).__name__}")
    if not json.dumps(arguments).isascii():
        raise ValueError("the tool call's arguments must be ASCII")
    return arguments


class ToolcallScript:
    """The token plan of one scripted call for a tokenizer (a `tokenizers.Tokenizer`)."""

    def __init__(self, tokenizer, name: str, arguments, *, pad_id: int = 12, silence_id: int = 11):

        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(f"the tool name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        self.name, self.arguments = name, parse_arguments(arguments)
        enc = lambda s: tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
        self.script = [MARKER_IDS["sotc"]] + enc(call_text(name, self.arguments)) + [MARKER_IDS["eotc"]]
        self.pad, self.silence, self.eotr = pad_id, silence_id, MARKER_IDS["eotr"]
        gt = enc(">")
        if len(gt) != 1:
            raise AssertionError("the synthetic tokenizer must spell '>' as one token")
        self.trigger = gt[0]  # the last token of every forced `</TOOL_RESPONSE>`
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # Counter and speech tokens: multi-letter pieces from the top of the vocabulary, none of them
        # a token of the script (whose embeddings must stay zero) nor the trigger.
        used = set(self.script) | {self.pad, self.silence, self.trigger}
        free = [i for i in range(len(vocab) - 1, -1, -1) if i not in used and i >= SPECIAL_COUNT + 256]
        n, m = len(self.script), SPEECH_WORDS
        if n > MAX_SCRIPT:
            raise ValueError(
                f"the call spells {n} tokens; the preset calls within its first {MAX_SCRIPT + 1} "
                f"frames, so at most {MAX_SCRIPT}: shorten the name or the arguments"
            )
        if len(free) < n + m:
            raise ValueError(
                f"the call needs {n + m} free tokens in a {len(vocab)}-token vocabulary; "
                "shorten the name or the arguments"
            )
        self.counter = free[:n]
        self.speech = free[n : n + m]

    @property
    def directions(self) -> list[int]:
        """The tokens with their own embedding direction, in dimension order."""
        return [self.pad, self.silence, self.trigger] + self.counter + self.speech

    def hidden_size(self) -> int:
        return 64 * -(-len(self.directions) // 64)

    def design(self, vocab_size: int, hidden: int) -> dict[str, np.ndarray]:
        """The embedding and both heads (MLX layout, float32)."""
        dim = {tok: d for d, tok in enumerate(self.directions)}
        emb = np.zeros((vocab_size, hidden), np.float32)
        for tok, d in dim.items():
            emb[tok, d] = 1.0
        text = np.zeros((vocab_size, hidden), np.float32)
        func = np.zeros((vocab_size, hidden), np.float32)
        strong, weak = 4.0, 1.0
        text[self.counter[0], dim[self.pad]] = weak  # (PAD, PAD): start counting
        text[self.speech[0], dim[self.trigger]] = weak  # (PAD, '>'): the response is in, speak
        func[self.pad, dim[self.pad]] = weak
        func[self.eotr, dim[self.trigger]] = weak
        chain = self.counter + [self.silence]
        for k, tok in enumerate(self.counter):
            text[chain[k + 1], dim[tok]] = strong
            func[self.script[k], dim[tok]] = strong
        words = self.speech + [self.silence]
        for k, tok in enumerate(self.speech):
            text[words[k + 1], dim[tok]] = strong
            func[self.pad, dim[tok]] = strong
        text[self.silence, dim[self.silence]] = strong
        func[self.pad, dim[self.silence]] = strong
        return {
            "stt_model.embed_tokens.weight": emb,
            "stt_model.lm_head.weight": text,
            "stt_model.function_head.weight": func,
        }


def toolcall_tensors(cfg, tokenizer, script: ToolcallScript, names) -> dict[str, np.ndarray]:
    """Every designed tensor of the preset (MLX names): heads, embedding, zeroed projections, norm_f."""
    t = cfg.text_config
    out = script.design(t.vocab_size, t.hidden_size)
    out["stt_model.llm.norm_f.weight"] = np.ones((t.hidden_size,), np.float32)
    for name, shape in names:
        if (
            name.startswith("stt_model.llm.layers.")
            and name.endswith((".mixer.out_proj.weight", ".mixer.o_proj.weight", ".mixer.down_proj.weight"))
        ) or name.startswith("stt_model.perception.proj."):
            out[name] = np.zeros(shape, np.float32)
    return out


def toolcall_overrides(script: ToolcallScript) -> dict:
    """Config overrides of the tiny preset for this script: the language path's width."""
    h = script.hidden_size()
    return {"text_config": {"hidden_size": h}, "audio_config": {"output_dim": h}}
