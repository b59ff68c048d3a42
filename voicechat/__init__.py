"""MLX implementation of NemotronLabs VoiceChat 11B: streaming full-duplex speech."""

__version__ = "0.1.0"


def load(path_or_repo, *, revision=None, **kwargs):
    """Load a checkpoint folder or Hugging Face repo id -> `VoiceChatModel` (see `voicechat.loading.load`)."""
    from .loading import load as _load

    return _load(path_or_repo, revision=revision, **kwargs)


__all__ = ["load", "__version__"]
