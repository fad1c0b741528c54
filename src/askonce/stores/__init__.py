"""Where state shared between calls lives: ``memory`` (the default, per process), ``redis`` and
``aredis`` (sync and asyncio Redis: shared by a fleet, with a bounded local fallback)."""
