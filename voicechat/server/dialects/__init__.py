"""The wire dialects a connection may speak, each a class of its own: mlx-vlm's (mlx_vlm.py, the
default on /v1/realtime), OpenAI Realtime GA (ga.py), OpenAI Live (live.py); common.py holds the
base class, what they share and how a connection picks one."""

from voicechat.server.dialects.common import Dialect
from voicechat.server.dialects.ga import GaDialect
from voicechat.server.dialects.live import LiveDialect
from voicechat.server.dialects.mlx_vlm import MlxVlmDialect

DIALECTS: dict[str, type[Dialect]] = {"mlx-vlm": MlxVlmDialect, "ga": GaDialect, "live": LiveDialect}


def make_dialect(name: str, conn) -> Dialect:
    """The dialect `name` ("mlx-vlm", "ga" or "live") serving connection `conn`."""
    try:
        return DIALECTS[name](conn)
    except KeyError:
        raise ValueError(f"unknown dialect {name!r}; expected one of {sorted(DIALECTS)}") from None
