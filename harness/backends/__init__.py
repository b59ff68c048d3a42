"""Backends the parity harness and the benchmark runner drive: this project, and mlx-vlm (peers extra)."""

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
    raise ValueError(f"unknown backend {name!r}; expected 'voicechat', 'voicechat-serial', "
                     "'voicechat-gpu-policy' or 'mlx-vlm'")


__all__ = ["Backend", "OfflineRun", "StreamRun", "get_backend"]
