"""Where state shared between calls lives: ``memory`` (the default, per process), ``redis`` and
``aredis`` (sync and asyncio Redis: shared by a fleet, with a bounded local fallback)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from askonce import _stats

if TYPE_CHECKING:
    from askonce.stores.memory import MemoryStore

_default: MemoryStore | None = None


def default_store() -> MemoryStore:
    """The process-wide in-memory store that layers share unless given another (made, and its
    module imported, on first use)."""
    global _default
    if _default is None:
        from askonce.stores.memory import MemoryStore

        _default = MemoryStore(_stats.monotonic)
    return _default
