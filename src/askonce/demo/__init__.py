"""``askonce demo``: naive nested retries against askonce on a real localhost stack, counted at the
target.

The pieces: :mod:`.params` (scenarios and settings), :mod:`.stack` (the processes),
:mod:`.layer_asgi`, :mod:`.layer_wsgi` and :mod:`.target` (what each process runs, with
:mod:`.naive` and :mod:`.child`), :mod:`.edge` (the load generator), :mod:`.runner` (one run),
:mod:`.measure` (the figures), :mod:`.report` (table, JSON, HTML), :mod:`.main` and :mod:`.cli` (the
command). :mod:`.inprocess` is the socket-free fallback, ``askonce demo --in-process``. See
``docs/demo.md``.
"""
