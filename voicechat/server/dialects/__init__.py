"""The wire dialects a connection may speak: OpenAI Realtime GA (ga.py), OpenAI Live (live.py);
common.py holds what they share and how a connection picks one."""

from voicechat.server.dialects.common import Dialect
from voicechat.server.dialects.ga import GaDialect
from voicechat.server.dialects.live import LiveDialect

DIALECTS: dict[str, type[Dialect]] = {"ga": GaDialect, "live": LiveDialect}


def make_dialect(name: str, conn) -> Dialect:
    """The dialect `name` ("ga" or "live") serving connection `conn`."""
    try:
        return DIALECTS[name](conn)
    except KeyError:
        raise ValueError(f"unknown dialect {name!r}; expected one of {sorted(DIALECTS)}") from None
