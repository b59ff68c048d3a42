"""What a benchmark ran on: machine, OS, MLX, package versions, checkpoints, git revision, date."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "voicechat-mlx",
    "mlx",
    "mlx-cpu",
    "mlx-metal",
    "numpy",
    "pandas",
    "matplotlib",
    "soundfile",
    "tokenizers",
    "huggingface-hub",
    "mlx-vlm",
    "mlx-audio",
    "mlx-lm",
    "transformers",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision(repo: Path | None = None) -> str | None:
    """`git rev-parse HEAD` of the source tree (read-only), or None outside a git checkout."""
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def sha256_file(path: Path) -> str | None:
    path = Path(path)
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_info(spec: str, folder: Path) -> dict:
    """Identity of one checkpoint: spec, folder, hashes of config.json and the index, synthetic or not."""
    folder = Path(folder)
    info: dict = {
        "spec": spec,
        "folder": str(folder),
        "config_sha256": sha256_file(folder / "config.json"),
        "index_sha256": sha256_file(folder / "model.safetensors.index.json"),
        "synthetic": False,
    }
    if str(spec).startswith("synthetic:"):
        from voicechat.synthetic.checkpoint import parse_synthetic_spec

        preset, bits, seed = parse_synthetic_spec(spec)
        info.update(synthetic=True, preset=preset, bits=bits, seed=seed)
    try:
        cfg = json.loads((folder / "config.json").read_text())  # Python's json accepts Infinity
        q = cfg.get("quantization") or {}
        info["quantization"] = {"bits": q.get("bits"), "group_size": q.get("group_size")} if q else None
    except (OSError, ValueError):
        info["quantization"] = None
    shards = sorted(folder.glob("*.safetensors"))
    info["weights_bytes_on_disk"] = int(sum(p.stat().st_size for p in shards))
    return info


def environment(checkpoints: list[dict] | None = None, *, date: datetime | None = None) -> dict:
    import mlx.core as mx

    from voicechat.runtime import ExecutionPolicy
    from voicechat.runtime.kernels import ISA_NAMES, extension, unavailable_reason

    date = date or datetime.now(UTC)
    try:
        metal = bool(mx.metal.is_available())
    except Exception:  # pragma: no cover - MLX builds without the metal module
        metal = False
    mem = _memory_bytes()
    return {
        "date": date.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "usable_cpus": _usable_cpus(),
            "memory_bytes": mem,
            "memory_gib": round(mem / 1024**3, 1) if mem else None,
        },
        "os": {"system": platform.system(), "release": platform.release(), "version": platform.version()},
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "mlx": {
            "version": getattr(mx, "__version__", None),
            "default_device": str(mx.default_device()),
            "metal_available": metal,
            # `voicechat` backend's policy (`voicechat-serial` / `voicechat-gpu-policy` run their own)
            "voicechat_policy": ExecutionPolicy.for_device().as_dict(),
            "voicechat_cpu_qmv_isa": ISA_NAMES[extension().isa()] if extension() is not None else None,
            "voicechat_cpu_qmv_unavailable": unavailable_reason(),
        },
        "packages": package_versions(),
        "git_revision": git_revision(),
        "checkpoints": checkpoints or [],
    }


__all__ = ["environment", "checkpoint_info", "git_revision", "package_versions", "sha256_file"]
