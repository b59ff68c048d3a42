"""Progress bars for long work (writing a synthetic checkpoint, loading, offline generation,
the bench, parity runs), on stderr through tqdm.

A bar is shown only when stderr is a terminal: logs, pipes and CI get nothing. The CLI's
`--quiet` turns bars off for the whole process (`set_quiet(True)`); `enabled=False` turns
one off. Two forms:

    for t in progress(range(n), desc="generating", unit="frame"):
        ...
    with bar(total=nbytes, desc="writing", unit="B") as b:   # or b = bar(...); ...; b.close()
        b.update(k)

Lines printed while a bar is on screen should go through `write(msg)` so they do not
tear the bar.
"""

from __future__ import annotations

import os
import sys

_state = {"quiet": False}  # the CLI's --quiet, for every bar of this process


def set_quiet(quiet: bool = True) -> None:
    """Silence (or allow again) every progress bar of this process; the CLI's `--quiet`."""
    _state["quiet"] = bool(quiet)


def is_enabled(enabled: bool | None = None) -> bool:
    """Whether a bar would be drawn: `enabled=None` means "when stderr is a terminal"."""
    if _state["quiet"] or enabled is False:
        return False
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced stderr
        tty = False
    return tty


class _NoBar:
    """What `bar` yields when bars are off: the same methods, doing nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_description(self, desc: str) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _tqdm(**kw):
    from tqdm import tqdm

    # leave=False: a finished bar is wiped, so the lines that matter (results, timings) stay readable.
    kw.setdefault("leave", False)
    try:
        width = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, AttributeError, ValueError):
        width = 0
    if width > 0:
        kw["dynamic_ncols"] = True  # follows the window when it is resized
    else:  # a terminal that reports no size (some ptys): tqdm would hide a 0x0 bar
        kw["ncols"], kw["nrows"] = 80, 24
    return tqdm(file=sys.stderr, mininterval=0.2, **kw)


def progress(
    iterable, *, total: int | None = None, desc: str | None = None, unit: str = "it", enabled: bool | None = None
):
    """`iterable`, drawing a bar while it is consumed (or `iterable` itself when bars are off)."""
    if not is_enabled(enabled):
        return iterable
    return _tqdm(iterable=iterable, total=total, desc=desc, unit=unit)


def bar(
    total: int | None = None,
    *,
    desc: str | None = None,
    unit: str = "it",
    unit_scale: bool = False,
    enabled: bool | None = None,
):
    """A bar advanced by hand with `.update(n)`: use it in a `with` block, or call `.close()`."""
    if not is_enabled(enabled):
        return _NoBar()
    return _tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale)


progress_bar = bar  # the name voicechat/synthetic/checkpoint.py was first written against


def write(msg: str, *, file=None) -> None:
    """Print a line to stderr (or `file`) without tearing a bar that is on screen."""
    if is_enabled():
        from tqdm import tqdm

        tqdm.write(msg, file=file or sys.stderr)
    else:
        print(msg, file=file or sys.stderr, flush=True)


__all__ = ["progress", "bar", "progress_bar", "write", "set_quiet", "is_enabled"]
