"""Runs a module as ``python -m`` does, without the working directory on ``sys.path``.

``python _boot.py MODULE ARGS...``: what :func:`versionwatch._process.python_module`
starts for the children of ``fix``, ``run --replay`` and the fork server. ``python
-m`` would put the working directory first on ``sys.path``, where a ``torch.py`` or
``json.py`` of the user's shadows the real one, which ``python sub/train.py`` never
does; the child then sets ``sys.path[0]`` to what the plain program gets.

It is a file of the package, not ``python -c`` code, so that its frame (under
every frame of the program) is one of ours, which reports leave out.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Run ``sys.argv[1]`` as ``__main__``, the rest of ``sys.argv`` its arguments."""
    # Run as a script, this file's folder (versionwatch/_cli) is sys.path[0]: the
    # folder that holds the package replaces it (under -P/PYTHONSAFEPATH there is
    # no such entry, and PYTHONPATH, which versionwatch._process.environment sets,
    # finds the package). Before any import that could read the script's folder.
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import runpy

    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
