"""How a frame is executed: the execution policy, the one place that rewrites weights for it,
the CPU kernels, and the runtime that implements the op seam (`voicechat.model.ops`) for a model.

Model components never import this package; `voicechat.load` prepares a model for a policy and
the session binds the model's runtime around each frame. See docs/runtime.md.
"""

from voicechat.runtime.execution import Runtime
from voicechat.runtime.policy import ENV_VARS, ExecutionPolicy
from voicechat.runtime.prepare import Prepared, prepare

__all__ = ["ENV_VARS", "ExecutionPolicy", "Prepared", "Runtime", "prepare"]
