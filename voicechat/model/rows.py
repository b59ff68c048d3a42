"""Residence of a conversation's cache in a block shared by the conversations of a tick.

A batched step leaves the bounded caches (Mamba states, the conformer's window) and the growing
ones (attention K/V) of several conversations as rows of one block per layer, which the next
step over them reads as it is. A cache says whether it lives in such a block and at which row;
the block's type and what a row holds are the cache's own (`MambaRows`, `ConformerRows`,
`AttentionRows`, `TtsKvRows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import mlx.core as mx

B = TypeVar("B")
S = TypeVar("S", bound="BlockRow[Any]")


class BlockRow(Generic[B]):
    """A cache that may be row `i` of a block of type B (`_block` = (block, i), or None: its own arrays)."""

    _block: tuple[B, int] | None = None

    @property
    def block(self) -> B | None:
        """The block this cache is a row of, or None when it holds its own arrays."""
        return None if self._block is None else self._block[0]

    def row_of(self, block: B) -> int | None:
        """This cache's row in `block`, or None when it is not (or no longer) there."""
        return self._block[1] if self._block is not None and self._block[0] is block else None


def block_with_room(states: list[S], make: Callable[[list[S]], B], place: Callable[[B, S, int], None]) -> B:
    """The block the stepping `states` take: the block of the first one that has one, with each
    state not in it put in a free row (`place(block, state, row)`: its own arrays only are copied);
    else `make(states)`, a new block (when none has one, or there are not enough free rows). A
    block's `members` list holds each row's state, None for a free row."""
    block = next((st.block for st in states if st.block is not None), None)
    if block is None:
        return make(states)
    members = block.members  # type: ignore[attr-defined]
    newcomers = [st for st in states if st.row_of(block) is None]
    free = [row for row, m in enumerate(members) if m is None]
    if len(newcomers) > len(free):
        return make(states)
    for st, row in zip(newcomers, free, strict=False):
        place(block, st, row)
    return block


def members_with(states: list[S]) -> list[S]:
    """A new block's members: `states`, then the other live members of the blocks they are in (a
    new block takes them along instead of cutting them out)."""
    members = list(states)
    for st in states:
        old = st.block
        if old is not None:
            members += [m for m in old.members if m is not None and all(m is not x for x in members)]  # type: ignore[attr-defined]
    return members


def padded_to(a: mx.array, capacity: int, axis: int = 2) -> mx.array:
    """`a` zero-padded along `axis` to `capacity` entries (`a` itself when it has them)."""
    have = a.shape[axis]
    if have >= capacity:
        return a
    shape = list(a.shape)
    shape[axis] = capacity - have
    return mx.concatenate([a, mx.zeros(shape, dtype=a.dtype)], axis=axis)


def spread_rows(a: mx.array, rows: list[int], size: int, per: int = 1) -> mx.array:
    """The stepping conversations' rows (S per, ...) -> a block's (size per, ...): conversation s's
    `per` rows at block rows per rows[s].., zeros in the others (`a` itself when the stepping
    conversations are the block's, in its order)."""
    if rows == list(range(size)):
        return a
    ext = mx.concatenate([a, mx.zeros((per, *a.shape[1:]), dtype=a.dtype)], axis=0)
    zero = per * len(rows)
    where = [zero + j for _ in range(size) for j in range(per)]
    for s, c in enumerate(rows):
        where[per * c : per * (c + 1)] = range(per * s, per * (s + 1))
    return ext[mx.array(where)]


def gather_rows(a: mx.array, rows: list[int], size: int, per: int = 1) -> mx.array:
    """A block's rows (size per, ...) -> the stepping conversations' (S per, ...) (`spread_rows` back)."""
    if rows == list(range(size)):
        return a
    return a[mx.array([per * c + j for c in rows for j in range(per)])]


__all__ = ["BlockRow", "block_with_room", "members_with", "padded_to", "spread_rows", "gather_rows"]
