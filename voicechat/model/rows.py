"""Residence of a conversation's cache in a block shared by the conversations of a tick.

A batched step leaves the bounded caches (Mamba states, the conformer's window) and the growing
ones (attention K/V) of several conversations as rows of one block per layer, which the next
step over them reads as it is. A cache says whether it lives in such a block and at which row;
the block's type and what a row holds are the cache's own (`MambaRows`, `ConformerRows`,
`AttentionRows`, `TtsKvRows`).
"""

from __future__ import annotations

from typing import Generic, TypeVar

B = TypeVar("B")


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


__all__ = ["BlockRow"]
