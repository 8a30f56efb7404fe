"""The predictor: what a backward would do, decided from its graph before it runs.

It owns ``check``, ``assert_backward_safe`` and the watcher's ``predict`` (``api``),
a backward call's own arguments judged as PyTorch judges them (``arguments``), the
graph walk (``graph``), the engine simulated (``engine``), the saved-tensor check
(``checker``) and where each node keeps its saved tensors (``slots``). ``api`` also
holds the explicit seam for observers of ``check`` (``CHECK_OBSERVERS``).
"""
