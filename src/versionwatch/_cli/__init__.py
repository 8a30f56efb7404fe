"""The ``versionwatch`` command: ``run``, ``merge``, ``demo``, ``native`` and ``fix``.

It owns argument parsing and running a script as ``__main__`` (``main``), what a
run writes (``outputs``: ``--json``, ``--dot``, ``--svg``), how a run ends
(``sigterm``), ``--replay`` (``replay``), ``merge`` of ranks' reports (``merge``)
and the bundled seed story (``demo``).
"""
