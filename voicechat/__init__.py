"""MLX implementation of NemotronLabs VoiceChat 11B: streaming full-duplex speech."""

__version__ = "0.1.0"


def load(path_or_repo, *, revision=None):
    """Load a checkpoint folder or Hugging Face repo id -> `VoiceChatModel` (see `voicechat.loading`)."""
    from .loading import load as _load

    return _load(path_or_repo, revision=revision)


__all__ = ["load", "__version__"]
