"""The pytest plugin (entry point ``pytest11``); opt-in.

- ``pytest --versionwatch``: every test runs watched, as under ``versionwatch run``;
  a predicted hazard fails the test with the explanation.
- ``pytest --versionwatch-strict``: the same in strict mode.
- ``@pytest.mark.versionwatch(on_hazard="raise", strict=False, stop_at_write=False)``:
  watch chosen tests only.
- the ``versionwatch`` fixture: yields the test's watcher (one is opened if needed).
- ``pytest --versionwatch-fix``: a test that fails on a hazard (predicted, or PyTorch's
  own error) gets ``versionwatch fix``'s best verified patch in its report: the
  test is run again as ``python -m pytest NODEID`` with each patch (docs/fix.md).

A failure versionwatch raised shows the test's own lines and the explanation, not
torch's frames (``--tb=short`` style; an explicit ``--tb`` or ``--full-trace`` is
left as asked), and a report's hint names ``--versionwatch-strict``.

This module imports neither torch nor versionwatch at pytest start-up; only a
test that is watched pays for the import.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Generator
from typing import TYPE_CHECKING, NoReturn, cast

import pytest
from _pytest._code import Traceback

from versionwatch._watch import POLICIES, Policy, env_problem

if TYPE_CHECKING:
    import pluggy

    from versionwatch._watch import AutoWatcher

_KEY = pytest.StashKey["AutoWatcher"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("versionwatch")
    group.addoption("--versionwatch", action="store_true", default=False,
                    help="watch every test: predict and explain inplace-modification errors")
    group.addoption("--versionwatch-strict", action="store_true", default=False,
                    help="like --versionwatch, in strict mode (each write to a saved tensor "
                    "is caught at its line)")
    group.addoption("--versionwatch-on-hazard", choices=POLICIES,
                    default="raise", help="what a hazard does under --versionwatch")
    group.addoption("--versionwatch-fix", action="store_true", default=False,
                    help="a test that fails on a hazard gets versionwatch fix's best verified "
                    "patch in its report (the test runs again once per candidate patch)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("versionwatch") or config.getoption("versionwatch_strict"):
        problem = env_problem()
        if problem is not None:  # as pytest says a bad --versionwatch-on-hazard
            raise pytest.UsageError(problem)
    config.addinivalue_line(
        "markers",
        "versionwatch(on_hazard='raise', strict=False, stop_at_write=False): watch this test "
        "with versionwatch "
        "(every module and optimizer it uses)",
    )


_MARKER_KEYWORDS = ("on_hazard", "strict", "stop_at_write")


def _usage_error(item: pytest.Item, problem: str) -> NoReturn:
    # An error of this test at setup, in one line: not a traceback through the plugin.
    pytest.fail(f"{item.nodeid}: {problem}", pytrace=False)


def _marker_policy(item: pytest.Item, marker: pytest.Mark,
                   strict: bool) -> tuple[Policy, bool, bool]:
    """``(on_hazard, strict, stop_at_write)`` from ``@pytest.mark.versionwatch(...)``."""
    usage = "@pytest.mark.versionwatch(on_hazard='raise', strict=False, stop_at_write=False)"
    if len(marker.args) > 1:
        _usage_error(item, f"@pytest.mark.versionwatch takes at most one positional argument "
                           f"(on_hazard), not {len(marker.args)}: {usage}")
    unknown = [k for k in marker.kwargs if k not in _MARKER_KEYWORDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], _MARKER_KEYWORDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        _usage_error(item, f"@pytest.mark.versionwatch got an unexpected keyword argument "
                           f"{unknown[0]!r}{hint}; it takes: {usage}")
    if marker.args and "on_hazard" in marker.kwargs:
        _usage_error(item, "@pytest.mark.versionwatch got on_hazard twice, as its positional "
                           "argument and as a keyword")
    policy = marker.kwargs.get("on_hazard", *marker.args or ("raise",))
    if not callable(policy) and policy not in POLICIES:
        _usage_error(item, f"@pytest.mark.versionwatch: on_hazard={policy!r} is not a valid "
                           f"policy; use one of: {', '.join(POLICIES)}, or a callable that "
                           "takes a Report")
    flags = []
    for name, default in (("strict", strict), ("stop_at_write", False)):
        value = marker.kwargs.get(name, default)
        if not isinstance(value, bool):  # bool("no") would be True
            _usage_error(item, f"@pytest.mark.versionwatch: {name}={value!r} is not True or "
                               "False")
        flags.append(value)
    return policy, flags[0], flags[1]


def _policy(item: pytest.Item) -> tuple[Policy, bool, bool] | None:
    """``(on_hazard, strict, stop_at_write)`` for a watched test, else ``None``."""
    config = item.config
    strict = bool(config.getoption("versionwatch_strict"))
    marker = item.get_closest_marker("versionwatch")
    if marker is not None:
        return _marker_policy(item, marker, strict)
    if config.getoption("versionwatch") or strict:
        # One of POLICIES: the option's choices.
        return cast(Policy, str(config.getoption("versionwatch_on_hazard"))), strict, False
    return None


def _open(item: pytest.Item, policy: tuple[Policy, bool, bool]) -> AutoWatcher:
    watcher = item.stash.get(_KEY, None)
    if watcher is None:
        problem = env_problem()
        if problem is not None:
            _usage_error(item, problem)
        from versionwatch._watch import watch_all

        watcher = watch_all(on_hazard=policy[0], strict=policy[1], stop_at_write=policy[2])
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
def versionwatch_fixture(request: pytest.FixtureRequest) -> AutoWatcher:
    """The test's watcher (opened for this test if the test isn't watched already)."""
    item = request.node
    return _open(item, _policy(item) or ("raise", False, False))


# PyTorch's own sentences for the two failures versionwatch fixes.
_SENTENCES = ("modified by an inplace operation", "backward through the graph a second time")


def _ours(err: BaseException) -> bool:
    """A failure versionwatch raised (a predicted hazard), not PyTorch's or the test's."""
    return type(err).__module__.split(".")[0] == "versionwatch" and hasattr(err, "report")


def _shorten(item: pytest.Item, excinfo: pytest.ExceptionInfo[BaseException],
             report: pytest.TestReport) -> None:
    """Our failure: the test's own lines and our explanation, not torch's frames.

    Our frames hide themselves (``__tracebackhide__``); the frames of torch between
    the test's last line and our raise (``Tensor.backward``'s source and docstring,
    some 60 lines) are cut here, and the test's lines are shown short (where, and
    the line), as pytest's ``--tb=short`` does: the report says the rest. An
    explicit ``--tb`` or ``--full-trace`` is left as asked.
    """
    import os

    torch = sys.modules.get("torch")
    if torch is None or torch.__file__ is None \
            or item.config.getoption("tbstyle", "auto") != "auto" \
            or item.config.getoption("fulltrace", False):
        return
    library = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    entries = [e for e in excinfo.traceback if not e.ishidden(excinfo)]
    first = next((i for i, e in enumerate(entries) if str(e.path) == str(item.path)), None)
    last = max((i for i, e in enumerate(entries) if not str(e.path).startswith(library)),
               default=None)
    if first is None or last is None or last < first:
        return
    kept = Traceback(entries[first:last + 1])
    try:
        moved = os.getcwd() != str(item.config.invocation_params.dir)
    except OSError:
        moved = True
    report.longrepr = excinfo.getrepr(style="short", abspath=moved, tbfilter=lambda _: kept)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None],
                              ) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    if call.excinfo is not None and _ours(call.excinfo.value):
        _shorten(item, call.excinfo, outcome.get_result())
    if not item.config.getoption("versionwatch_fix") or call.when != "call" \
            or call.excinfo is None:
        return
    err = call.excinfo.value
    if not isinstance(err, RuntimeError) or not any(s in str(err) for s in _SENTENCES):
        return
    report = outcome.get_result()
    try:
        text = _fix_test(item, err)
    except Exception as e:  # the test's own failure stands; say why there is no patch
        text = f"versionwatch fix could not run: {type(e).__name__}: {e}"
    report.sections.append(("versionwatch fix", text))


def _fix_test(item: pytest.Item, err: BaseException) -> str:
    """``versionwatch fix`` on ``python -m pytest NODEID``: the best verified patch, as text."""
    import os

    from versionwatch._candidates import shown
    from versionwatch._fix import fix

    root = str(item.config.rootpath)
    program = ["-m", "pytest", item.nodeid, "-q", "-p", "no:cacheprovider",
               # Test modules imported as they are, not rewritten by pytest from the
               # original file: each check imports the patched copy.
               "--assert=plain"]
    here = os.getcwd()
    os.chdir(root)
    try:
        result = fix(program)
        lines = []
        if result.status != "checked":
            said = (result.notes[0] if result.status == "too_big" and result.notes
                    else f"the test, run again, gave {result.status.replace('_', ' ')}")
            lines.append(f"no patch: {said}")
        elif not result.candidates:
            # No edit of the test's code fits this failure: the report's advice stands.
            advice = _advice(err, result)
            lines.append("no patch was verified: no candidate patch fits this failure"
                         + (f"; the report's fix: {advice}" if advice else ""))
        elif not result.verified:
            lines.append(f"no patch was verified: none of {len(result.candidates)} "
                         "candidate patch(es) trains as the test does:")
            lines += [f"  {c.family} at {shown(c.file)}:{c.line}: {c.why}"
                      for c in result.candidates]
        else:
            best = result.verified[0]
            lines += [f"verified: {best.summary}", f"  {best.why}", best.diff.rstrip("\n")]
            more = len(result.verified) - 1
            if more:
                lines.append(f"({more} more verified: `versionwatch fix -m pytest "
                             f"{item.nodeid} --assert=plain` shows them)")
    finally:
        os.chdir(here)
    own = getattr(err, "report", None)
    if own is not None and own.hazards and result.report is not None and result.report.hazards:
        own.hazards[0].fixes = result.report.hazards[0].fixes  # for whoever reads the error
    return "\n".join(lines)


def _advice(err: BaseException, result: object) -> str:
    """The fix the failure's report gives, for a failure no patch fits; ``""`` if none."""
    for report in (getattr(err, "report", None), getattr(result, "report", None)):
        hazards = getattr(report, "hazards", None)
        if hazards and hazards[0].fix:
            return str(hazards[0].fix)
    return ""
