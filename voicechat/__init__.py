"""MLX implementation of NemotronLabs VoiceChat 11B: streaming full-duplex speech."""

__version__ = "0.1.0"


def load(path_or_repo, *, revision=None, **kwargs):
    """Load a checkpoint folder or Hugging Face repo id -> `VoiceChatModel` (see `voicechat.loading.load`)."""
    from .loading import load as _load

    return _load(path_or_repo, revision=revision, **kwargs)


def __getattr__(name):
    # `voicechat.PromptState` without importing MLX at `import voicechat`.
    if name == "PromptState":
        from .prompt_state import PromptState

        return PromptState
    raise AttributeError(f"module 'voicechat' has no attribute {name!r}")


__all__ = ["load", "__version__", "PromptState"]
