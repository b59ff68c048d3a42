"""MLX implementation of NemotronLabs VoiceChat 11B: streaming full-duplex speech.

The public names: `load` (a checkpoint -> `VoiceChatModel`), `ExecutionPolicy` (how its frames
run), `PromptState` (a prefilled system prompt); `voicechat.errors` and `voicechat.events`. The
layers below, each a folder: model/ (the math), runtime/ (how a frame executes), io/ (disk),
tools/ (the function channel), streaming/ (conversations over time), synthetic/ (checkpoints for
tests and benchmarks), server/ and cli/ (the apps). `import voicechat` stays light: MLX is
imported with the first of these names that needs it.
"""

from typing import TYPE_CHECKING

from voicechat._version import __version__

if TYPE_CHECKING:  # imported on first use at run time (see __getattr__)
    from voicechat.runtime.policy import ExecutionPolicy
    from voicechat.streaming.prompt_state import PromptState


def load(path_or_repo, *, revision=None, **kwargs):
    """Load a checkpoint folder or Hugging Face repo id -> `VoiceChatModel` (see `voicechat.streaming.model.load`)."""
    from voicechat.streaming.model import load as _load

    return _load(path_or_repo, revision=revision, **kwargs)


def __getattr__(name):
    # Deferred so that `import voicechat` does not import MLX.
    if name == "PromptState":
        from voicechat.streaming.prompt_state import PromptState

        return PromptState
    if name == "ExecutionPolicy":
        from voicechat.runtime.policy import ExecutionPolicy

        return ExecutionPolicy
    raise AttributeError(f"module 'voicechat' has no attribute {name!r}")


__all__ = ["ExecutionPolicy", "PromptState", "__version__", "load"]
