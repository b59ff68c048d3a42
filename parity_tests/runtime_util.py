"""Execution policies for tests: the device's default policy (environment variables ignored, so a
developer's `VOICECHAT_*` settings do not change what a test checks) and a with-block that binds a
policy's runtime on this thread, as a session binds its model's around each frame."""

from __future__ import annotations

from voicechat.model import ops
from voicechat.runtime import ExecutionPolicy, Runtime
from voicechat.runtime.policy import UNBOUND


def default_policy(**changes) -> ExecutionPolicy:
    """`ExecutionPolicy.for_device()` without environment overrides, with `changes` applied."""
    base = ExecutionPolicy.for_device(environ={})
    return base.replace(**changes) if changes else base


def running(policy: ExecutionPolicy | None = None, **changes):
    """A with-block running components under `policy` (default: `default_policy(**changes)`)."""
    if policy is None:
        policy = default_policy(**changes)
    elif changes:
        policy = policy.replace(**changes)
    return Runtime(policy).frame()


def bound_policy() -> ExecutionPolicy:
    """The policy of the runtime bound on this thread, `UNBOUND` outside one: what the runtime's
    functions are handed when components call the op seam here (the runtime itself never looks
    it up: `Runtime` passes its own)."""
    policy = ops.current().policy
    return UNBOUND if policy is None else policy


# The policies every identity test runs: this device's, MLX's own kernels on one stream, and the
# one a GPU device gets (run on this device, so Apple Silicon's branches run in CI).
POLICIES = {
    "device": default_policy,
    "serial": ExecutionPolicy.serial,
    "gpu": ExecutionPolicy.gpu,
}

__all__ = ["POLICIES", "bound_policy", "default_policy", "running"]
