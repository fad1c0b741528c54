"""Where state shared between calls lives: ``memory`` (the default, per process), ``redis`` and
``aredis`` (sync and asyncio Redis: shared by a fleet, with a bounded local fallback)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from askonce import _stats

if TYPE_CHECKING:
    from askonce.core.admission import AdmissionPolicy
    from askonce.stores.base import AdmissionHandle
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


def admissions_of(store: object) -> Callable[[str, AdmissionPolicy], AdmissionHandle]:
    """Where a layer's admission controllers live: ``store.admission``, or, for a store of the
    application's own that has none, the process's memory store (admission is on by default, and
    such a store predates it)."""
    admission: Any = getattr(store, "admission", None)
    if callable(admission):
        return admission  # type: ignore[no-any-return]
    return default_store().admission
