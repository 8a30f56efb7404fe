"""Repository-wide pytest configuration (it also covers the doctests collected under src/)."""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("lightning") is None and (
    importlib.util.find_spec("pytorch_lightning") is None
):
    # The Lightning callback imports Lightning; without it (pip install -e '.[test]'),
    # skip its module instead of failing the doctest collection.
    collect_ignore.append("src/versionwatch/integrations/lightning.py")

# Programs that the tests run as scripts (under versionwatch run, or patched by
# versionwatch fix): --doctest-modules must not import, and so run, them.
collect_ignore_glob = ["tests/explain_programs/*", "tests/fix_programs/*"]

# The Hugging Face callback imports transformers (pip install -e '.[transformers]').
if importlib.util.find_spec("transformers") is None:
    collect_ignore.append("src/versionwatch/integrations/transformers.py")
