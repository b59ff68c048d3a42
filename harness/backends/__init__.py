"""Backends the parity harness and the benchmark runner drive: this project, mlx-vlm and mlx-audio (peers extra)."""

from .base import Backend, OfflineRun, StreamRun


def get_backend(name: str) -> "Backend":
    if name == "voicechat":
        from .voicechat_backend import VoiceChatBackend

        return VoiceChatBackend()
    if name == "voicechat-serial":
        from .voicechat_backend import SerialVoiceChatBackend

        return SerialVoiceChatBackend()
    if name == "voicechat-gpu-policy":
        from .voicechat_backend import GpuPolicyVoiceChatBackend

        return GpuPolicyVoiceChatBackend()
    if name == "mlx-vlm":
        from .mlx_vlm_backend import MlxVlmBackend

        return MlxVlmBackend()
    if name == "mlx-audio":
        from .mlx_audio_backend import MlxAudioBackend

        return MlxAudioBackend()
    raise ValueError(
        f"unknown backend {name!r}; expected 'voicechat', 'voicechat-serial', "
        "'voicechat-gpu-policy', 'mlx-vlm' or 'mlx-audio'"
    )


__all__ = ["Backend", "OfflineRun", "StreamRun", "get_backend"]
