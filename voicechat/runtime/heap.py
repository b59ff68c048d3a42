"""glibc's heap kept for a frame's large temporaries (Linux, CPU device).

MLX's CPU allocator is malloc. At the published shapes a frame allocates and frees large
temporaries (bf16 weights widened to float32 for MLX's products, tens per frame).
By default glibc gives the top of the heap back to the kernel whenever more than 128 KB is free
there, and serves requests over a moving threshold with mmap; which temporaries end up unmapped
(and fault their pages in again on the next frame) then depends on whatever small buffers happen
to be live beside them, so an unrelated change could make a frame several times slower through
page faults (docs/performance.md); with the two settings below it does not.

`keep_heap()` sets M_TRIM_THRESHOLD to 1 GiB and M_MMAP_THRESHOLD to 32 MiB (the most glibc's
moving threshold reaches on 64-bit; setting either stops it moving), once per process. Freed memory then stays in
the heap for the next frame's temporaries: the resident set keeps its peak instead of shrinking
between frames (the peak itself is what the frame needs either way). It is process-wide, so
other MLX code in the same process (a second model) gets it too. `prepare` calls it when the
policy's `keep_heap` is on (the CPU default on Linux; `VOICECHAT_KEEP_HEAP=0` turns it off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
TRIM_THRESHOLD_BYTES = 1 << 30
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit

_lock = threading.Lock()
_done: list = []  # [True] once set in this process


def served() -> bool:
    """Linux with glibc (`mallopt` is glibc's)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _mallopt(param: int, value: int) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc.mallopt(ctypes.c_int(param), ctypes.c_int(value))


def keep_heap() -> bool:
    """Set the two thresholds once (see the module doc). True when they are set (now or
    before), False where not served; RuntimeError if glibc refuses."""
    if not served():
        return False
    with _lock:
        if not _done:
            for param, value, name in (
                (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES, "M_MMAP_THRESHOLD"),
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES, "M_TRIM_THRESHOLD"),
            ):
                if _mallopt(param, value) != 1:
                    raise RuntimeError(
                        f"glibc mallopt({name}, {value}) failed; set VOICECHAT_KEEP_HEAP=0 "
                        "(a policy with keep_heap off) to leave the defaults"
                    )
            _done.append(True)
    return True


__all__ = ["keep_heap", "served"]
