"""The pure core of askonce: state machines and codecs with no I/O, no clock reads and no sleeping.

Everything here takes time (``now``, monotonic seconds) and randomness as inputs, so the sync and async
shells, the integrations and the simulator all drive the very same objects.
"""
