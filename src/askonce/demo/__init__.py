"""``askonce demo``: naive nested retries against askonce, measured at the target."""
