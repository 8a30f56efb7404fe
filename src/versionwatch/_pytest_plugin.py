"""The pytest plugin (entry point ``pytest11``); opt-in.

- ``pytest --versionwatch``: every test runs watched, as under ``versionwatch run``;
  a predicted hazard fails the test with the explanation.
- ``pytest --versionwatch-strict``: the same in strict mode.
- ``@pytest.mark.versionwatch(on_hazard="raise", strict=False, stop_at_write=False)``:
  watch chosen tests only.
- the ``versionwatch`` fixture: yields the test's watcher (one is opened if needed).

This module imports neither torch nor versionwatch at pytest start-up; only a
test that is watched pays for the import.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from versionwatch._config import POLICIES

_KEY = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("versionwatch")
    group.addoption("--versionwatch", action="store_true", default=False,
                    help="watch every test: predict and explain inplace-modification errors")
    group.addoption("--versionwatch-strict", action="store_true", default=False,
                    help="like --versionwatch, in strict mode (each write to a saved tensor "
                    "is caught at its line)")
    group.addoption("--versionwatch-on-hazard", choices=POLICIES,
                    default="raise", help="what a hazard does under --versionwatch")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "versionwatch(on_hazard='raise', strict=False, stop_at_write=False): watch this test "
        "with versionwatch "
        "(every module and optimizer it uses)",
    )


def _policy(item: pytest.Item) -> tuple[str, bool, bool] | None:
    """``(on_hazard, strict, stop_at_write)`` for a watched test, else ``None``."""
    config = item.config
    strict = bool(config.getoption("versionwatch_strict"))
    marker = item.get_closest_marker("versionwatch")
    if marker is not None:
        policy = marker.kwargs.get("on_hazard", *marker.args or ("raise",))
        return (str(policy), bool(marker.kwargs.get("strict", strict)),
                bool(marker.kwargs.get("stop_at_write", False)))
    if config.getoption("versionwatch") or strict:
        return str(config.getoption("versionwatch_on_hazard")), strict, False
    return None


def _open(item: pytest.Item, policy: tuple[str, bool, bool]) -> Any:
    watcher = item.stash.get(_KEY, None)
    if watcher is None:
        from versionwatch._auto import watch_all

        watcher = watch_all(on_hazard=policy[0], strict=policy[1],  # type: ignore[arg-type]
                            stop_at_write=policy[2])
        item.stash[_KEY] = watcher
    return watcher


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    policy = _policy(item)
    if policy is not None:
        _open(item, policy)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    yield
    watcher = item.stash.get(_KEY, None)
    if watcher is not None:
        watcher.close()
        del item.stash[_KEY]


@pytest.fixture(name="versionwatch")
def versionwatch_fixture(request: pytest.FixtureRequest) -> Any:
    """The test's watcher (opened for this test if the test isn't watched already)."""
    item = request.node
    return _open(item, _policy(item) or ("raise", False, False))
