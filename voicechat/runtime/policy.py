"""`ExecutionPolicy`: how a model's frames are executed, chosen once at `load` and frozen.

A policy changes where and how operations run, never what they compute: every policy gives the
same ids, codes and caches bit for bit; only the codec's host products (`host_products`) round
differently (float32 summation order). The fields:

- `cpu_streams` (1 or 2): large products split in two halves on two CPU streams (`runtime.linear`);
  with several conversations in a tick, their codec host products on as many threads.
- `compiled`: fixed-shape pieces compiled with `mx.compile` (`runtime.compiled`).
- `cpu_kernels`: this project's CPU kernels (`runtime.kernels`, Linux x86-64).
- `host_products`: the codec's float32 products through numpy's BLAS (`runtime.host_products`).
- `overlap`: each layer's output evaluated while the next is built (`mx.async_eval`).
- `keep_heap`: glibc keeps freed large temporaries for the next frame (`runtime.heap`).
- `rnnt_on_device`: the RNNT's greedy symbols as masked device arithmetic, read once per frame
  with the frame's other results, instead of one host round trip per symbol (a GPU's queue
  stalls at each; on a CPU a round trip is cheaper than the masked iterations).
- `float32_copies` (True, False, or None = while they add at most 1 GiB) and `bf16_transposed`
  (bf16 dense weights stored as their W.T, the same bytes): the layout `prepare` gives 16-bit
  dense weights.

`ExecutionPolicy.for_device(device)` is the default for a device; the environment variables
`VOICECHAT_CPU_STREAMS`, `VOICECHAT_COMPILE`, `VOICECHAT_CPU_QMV`, `VOICECHAT_HOST_GEMM`,
`VOICECHAT_OVERLAP`, `VOICECHAT_KEEP_HEAP` and `VOICECHAT_FLOAT32_COPIES` override its fields
there, read once. `ExecutionPolicy.serial()` runs everything with MLX's own kernels on one
stream; `ExecutionPolicy.for_device(mx.gpu)` is what a Metal device gets, and runs on a CPU
device too (CI runs it there).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import mlx.core as mx

from voicechat.environment import env_flag
from voicechat.runtime import heap, kernels

ENV_VARS = {
    "cpu_streams": "VOICECHAT_CPU_STREAMS",
    "compiled": "VOICECHAT_COMPILE",
    "cpu_kernels": "VOICECHAT_CPU_QMV",
    "host_products": "VOICECHAT_HOST_GEMM",
    "overlap": "VOICECHAT_OVERLAP",
    "keep_heap": "VOICECHAT_KEEP_HEAP",
    "float32_copies": "VOICECHAT_FLOAT32_COPIES",
}


def _streams(value, where: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n not in (1, 2):
        raise ValueError(f"{where} must be 1 or 2 (CPU streams per frame), got {value!r}")
    return n


@dataclass(frozen=True)
class ExecutionPolicy:
    name: str
    cpu_streams: int = 1
    compiled: bool = False
    cpu_kernels: bool = False
    host_products: bool = False
    overlap: bool = False
    keep_heap: bool = False
    rnnt_on_device: bool = False
    float32_copies: bool | None = False
    bf16_transposed: bool = False

    def __post_init__(self):
        _streams(self.cpu_streams, "ExecutionPolicy.cpu_streams")
        for field in (
            "compiled",
            "cpu_kernels",
            "host_products",
            "overlap",
            "keep_heap",
            "rnnt_on_device",
            "bf16_transposed",
        ):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"ExecutionPolicy.{field} must be True or False, got {getattr(self, field)!r}")
        if self.float32_copies not in (True, False, None):
            raise TypeError(f"ExecutionPolicy.float32_copies must be True, False or None, got {self.float32_copies!r}")
        if self.cpu_kernels and kernels.extension() is None:
            raise RuntimeError(
                f"ExecutionPolicy(cpu_kernels=True): the CPU kernels cannot be used here: "
                f"{kernels.unavailable_reason()}"
            )

    # -- the policies a device gets

    @classmethod
    def for_device(cls, device=None, environ: Mapping[str, str] | None = None) -> ExecutionPolicy:
        """The default policy for `device` (default: MLX's default device), with the environment
        variables of `ENV_VARS` (read here, once) overriding its fields. On a CPU device the
        CPU kernels are used where they build and pass their check; where they do not, one
        warning says why (forcing them on with `VOICECHAT_CPU_QMV=1` then raises)."""

        environ = os.environ if environ is None else environ
        device = (
            mx.default_device()
            if device is None
            else mx.Device(device)
            if not isinstance(device, mx.Device)
            else device
        )
        cpu = device.type == mx.DeviceType.cpu
        env = {field: env_flag(var, environ) for field, var in ENV_VARS.items() if field != "cpu_streams"}
        streams_env = environ.get(ENV_VARS["cpu_streams"], "").strip()
        if streams_env:
            streams = _streams(streams_env, ENV_VARS["cpu_streams"])
        else:
            streams = 2 if cpu and (os.cpu_count() or 1) >= 2 else 1
        kernels_on = env["cpu_kernels"]
        if kernels_on is None:
            kernels_on = cpu and kernels.platform_served()
            if kernels_on and kernels.extension() is None:
                warnings.warn(
                    f"voicechat: the CPU kernels (quantized and float32 products) are not used "
                    f"({kernels.unavailable_reason()}); MLX's kernels give the same results, several "
                    f"times slower on this CPU. Set {ENV_VARS['cpu_kernels']}=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                kernels_on = False
        elif kernels_on and kernels.extension() is None:
            raise RuntimeError(
                f"{ENV_VARS['cpu_kernels']}=1, but the CPU kernels cannot be used: {kernels.unavailable_reason()}"
            )

        def pick(field, default):
            return default if env[field] is None else env[field]

        return cls(
            name="cpu" if cpu else "gpu",
            cpu_streams=streams,
            compiled=pick("compiled", True),
            cpu_kernels=kernels_on,
            host_products=pick("host_products", cpu),
            overlap=pick("overlap", cpu),
            keep_heap=pick("keep_heap", cpu and heap.served()),
            rnnt_on_device=not cpu,
            float32_copies=pick("float32_copies", None if cpu else False),
            # bf16 W.T keeps the stored bytes: on a GPU (and where the CPU kernels widen it) the
            # product reads it as is; MLX's CPU kernels would convert it per call (float32 copies then).
            bf16_transposed=kernels_on if cpu else True,
        )

    @classmethod
    def serial(cls) -> ExecutionPolicy:
        """One CPU stream, nothing compiled, every product in MLX, nothing evaluated ahead: the
        model's operations as MLX runs them (`voicechat-serial` in the harness and the bench)."""
        return cls(name="serial", float32_copies=None)

    @classmethod
    def gpu(cls) -> ExecutionPolicy:
        """What a GPU device gets (`for_device(mx.gpu)` without environment overrides)."""
        return cls.for_device(mx.gpu, environ={})

    def replace(self, **changes) -> ExecutionPolicy:
        """A copy with `changes` (named "custom" unless a name is given)."""
        changes.setdefault("name", "custom")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The fields, for reports (`env.json`, a session's profile)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return describe_fields(self.as_dict())


# The on / off fields, in the order reports list them.
SWITCHES = ("compiled", "cpu_kernels", "host_products", "overlap", "keep_heap", "rnnt_on_device", "bf16_transposed")


def switched_on(fields: Mapping) -> list[str]:
    """The on / off fields that are on, of a policy's fields (`as_dict()`, or as read from a report)."""
    return [f for f in SWITCHES if fields.get(f)]


def describe_fields(fields: Mapping) -> str:
    """One line for a policy's fields (`as_dict()`, or as read from a report)."""
    streams, copies, on = fields.get("cpu_streams"), fields.get("float32_copies"), switched_on(fields)
    return (
        f"{fields.get('name')}: {streams} CPU stream{'s' if streams != 1 else ''}, "
        + (", ".join(on) if on else "nothing else")
        + f", float32 copies {'by budget' if copies is None else copies}"
    )


# What a prepared layer runs under when no model's runtime is bound (a component called on its
# own: the plain ops pass no policy): one stream, nothing on.
UNBOUND = ExecutionPolicy(name="unbound")


__all__ = ["ENV_VARS", "ExecutionPolicy", "SWITCHES", "UNBOUND", "describe_fields", "switched_on"]
