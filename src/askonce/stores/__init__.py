"""Where state shared between calls lives: in memory by default (``memory``), fleet-wide in Redis later."""
