"""The watcher: ``watch()``, ``watch_all()`` and everything that happens while one is open.

It owns the ``Watcher`` and its parts (forward recording, optimizer tracking, the
backward pipeline, blame), the policy on a hazard (``policy``), which watchers are
open (``active``), where the training loop's events enter (``intercept``, and
``forward`` for a root module's forward), freed graphs' carriers (``carrier``),
backwards in flight on other threads (``inflight``), zero-code watching (``auto``)
and the typed faces the interception points call (``protocols``).
"""
