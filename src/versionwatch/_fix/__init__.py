"""``versionwatch fix``: a candidate patch checked by running the patched program.

It owns the command and its result (``command``: ``fix``, ``FixResult``), running
a patched program and judging what it did (``check``), the child process that runs
the program or a patched copy (``child``) and the fork server that imports torch
once (``server``). The candidates themselves come from ``_candidates``.
"""
