"""The flags several commands share, written once: which model, its numerics, the system prompt,
the seed, tools, progress output."""

from __future__ import annotations

from argparse import ArgumentParser

from voicechat.model.tts.numerics import DEFAULT_NUMERICS, NUMERICS

DEFAULT_MODEL = "synthetic:tiny"
MODEL_HELP = "checkpoint folder, Hugging Face repo id, or synthetic:PRESET[:4|8]"


def add_model(p: ArgumentParser, *, required: bool = False, note: str = "") -> None:
    """-m / --model: a checkpoint (default: a random-weight tiny model, written on first use)."""
    if required:
        p.add_argument("-m", "--model", required=True, help=MODEL_HELP + note)
    else:
        p.add_argument(
            "-m",
            "--model",
            default=DEFAULT_MODEL,
            help=f"{MODEL_HELP} (default {DEFAULT_MODEL}: a random-weight tiny model, written on first use){note}",
        )


def add_numerics(p: ArgumentParser, note: str = "") -> None:
    p.add_argument(
        "--numerics",
        choices=sorted(NUMERICS),
        default=DEFAULT_NUMERICS,
        help="reference (default: rounds as mlx-vlm does, the same ids and codes) or float32 "
        "(EAR-TTS and the language path in float32; docs/voicechat.md, Numerics)" + note,
    )


def add_prompt(p: ArgumentParser, help: str = "system prompt (default: the config's)") -> None:
    p.add_argument("-p", "--prompt", default=None, help=help)


def add_seed(p: ArgumentParser, default: int | None = 0) -> None:
    p.add_argument("--seed", type=int, default=default, help="random seed of the TTS sampler (default 0)")


def add_tools(p: ArgumentParser, help: str) -> None:
    p.add_argument("--tools", default=None, metavar="tools.json", help=help)


def add_quiet(p: ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars (they are shown only on a terminal)")


__all__ = ["DEFAULT_MODEL", "add_model", "add_numerics", "add_prompt", "add_quiet", "add_seed", "add_tools"]
