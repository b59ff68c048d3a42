"""Per-model numerics of EAR-TTS: where it rounds to the weight dtype (docs/model.md §8, §12).

The reference (mlx-vlm) keeps most of EAR-TTS in float32 but rounds to the
stored weight dtype (bf16 in the published checkpoints) in a few places that
move the argmax / argmin decisions of the code generator. `Numerics` says, per
model, which of them this project reproduces:

* `backbone_norm_one_plus_w_in_weight_dtype`: "1 + w" of the backbone norms
  formed in the weight dtype (§12.2 item 6);
* `text_side_in_weight_dtype`: the char-aware subword encoder, the flag
  embeddings, `null_emb`, the fusion's text projection and its σ(gate),
  σ(residual_scale) computed in the char embedding's dtype (~1e-2 on the fused
  input with bf16 weights);
* `rvq_norms_in_weight_dtype`: the squared codebook norms ‖e_j‖² of the greedy
  RVQ distances computed from the stored codebooks in their dtype, in both greedy
  RVQs: EAR-TTS's over `rvq_embs` and the codec encoder's over `mus_list` (the
  speaker prompt codes of the warm-up, `Codec.encode`). With bf16 codebooks of
  1024 entries, late codebooks have top-2 distance gaps below bf16's rounding of
  ‖e_j‖², so this rounding decides codes there;
* `mog_log_probs_as_log_of_softmax`: the MoG component log-probabilities as
  log(softmax(filtered logits)) instead of logits − logsumexp (~1 ulp apart;
  matters only at a Gumbel near-tie);
* `language_rounding_as_reference` (the language path, not EAR-TTS): Nemotron-H's
  decay rate -exp(A_log) in A_log's stored dtype and the system prompt stepped one
  position at a time, as the reference does (`NemotronH(reference_rounding=...)`);
  off: A in float32 and the prompt in one sequence pass;
* `streaming_mel_edge_as_reference` (perception): the session's streamed first log-mel
  frame built as the reference's streaming frontend builds it (its reflection one
  sample short; `StreamingLogMel(reference_edge=...)`), float rounding apart from
  the offline frame.

Not a numerics setting: the reference's offline frame 0 without a system prompt
(an all-zero code row, §12.2 item 7) is a bug that breaks its own streamed =
offline agreement; offline frame 0 here is the codec silence codes, as streaming,
under both settings (harness difference `frame0_codes_no_prompt`).

Two settings, chosen at load (`voicechat.load(path, numerics=...)`):
"reference" (default: all of the above, so ids, function ids and every code
equal mlx-vlm's for the same checkpoint, input and seed, offline frame 0 without a
prompt apart) and "float32" (none:
EAR-TTS in float32 throughout). The setting is a frozen value
carried by the model, read by its modules; nothing is process-wide, so models
with different settings can live in one process and run in different threads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Numerics:
    name: str
    backbone_norm_one_plus_w_in_weight_dtype: bool
    text_side_in_weight_dtype: bool
    rvq_norms_in_weight_dtype: bool
    mog_log_probs_as_log_of_softmax: bool
    language_rounding_as_reference: bool = True  # Nemotron-H: see voicechat.model.llm.nemotron_h
    streaming_mel_edge_as_reference: bool = True  # StreamingLogMel(reference_edge=...)


REFERENCE = Numerics("reference", True, True, True, True, True, True)
FLOAT32 = Numerics("float32", False, False, False, False, False, False)
NUMERICS: dict[str, Numerics] = {n.name: n for n in (REFERENCE, FLOAT32)}
DEFAULT_NUMERICS = REFERENCE.name


def numerics_from(value) -> Numerics:
    """A `Numerics` from its name ("reference" / "float32") or a `Numerics`; ValueError / TypeError
    naming the choices for anything else."""
    if isinstance(value, Numerics):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"numerics: expected one of {', '.join(repr(k) for k in NUMERICS)}, got {type(value).__name__} {value!r}"
        )
    if value not in NUMERICS:
        raise ValueError(f"numerics: expected one of {', '.join(repr(k) for k in NUMERICS)}, got {value!r}")
    return NUMERICS[value]


__all__ = ["Numerics", "REFERENCE", "FLOAT32", "NUMERICS", "DEFAULT_NUMERICS", "numerics_from"]
