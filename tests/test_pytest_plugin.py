"""The pytest plugin, through pytester in subprocesses (entry point pytest11)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TESTS = """
import pytest
import torch

def make():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)

def stale_backward():
    model, opt = make()
    loss = model(torch.ones(1, 2)).sum()
    loss.backward(retain_graph=True)
    opt.step()
    loss.backward()

def test_bad():
    stale_backward()

def test_good():
    model, opt = make()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()

@pytest.mark.versionwatch(on_hazard="raise")
def test_marked():
    stale_backward()

def test_fixture(versionwatch):
    model, opt = make()
    model(torch.ones(1, 2)).sum().backward()
    assert sorted(versionwatch.ledger.by_name)[0] == "model.0.bias"
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def test_opt_in_flag_watches_every_test(suite: pytest.Pytester):
    result = suite.runpytest_subprocess("--versionwatch", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "*InplaceModificationError: versionwatch: backward will fail: model.2.weight saved by "
        "AddmmBackward0 was modified by an inplace operation*",
        "*modified by  opt.step() #1 at test_suite.py:12*",
    ])
    assert "_watch/watcher.py" not in result.stdout.str()  # our frames are hidden


def test_without_the_flag_only_marked_tests_are_watched(suite: pytest.Pytester):
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    # The failure sections only: under CI=true pytest prints the summary untruncated.
    out = result.stdout.str().split("short test summary info")[0]
    assert out.count("versionwatch: backward will fail") == 1  # test_marked only
    assert "RuntimeError: one of the variables needed for gradient computation" in out


def test_warn_policy_from_the_command_line(suite: pytest.Pytester):
    result = suite.runpytest_subprocess(
        "--versionwatch", "--versionwatch-on-hazard", "warn", "-p", "no:cacheprovider",
        "-k", "test_bad")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*versionwatch predicted this*", "*test_suite.py:13: InplaceHazardWarning*"])


def test_plugin_import_is_light():
    code = ("import sys, versionwatch.integrations.pytest_plugin; "
            "assert 'torch' not in sys.modules, 'torch imported at pytest start-up'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_import_versionwatch_pulls_in_no_optional_integration():
    code = ("import sys, versionwatch; "
            "heavy = {'lightning', 'pytorch_lightning', 'rich', 'matplotlib', 'accelerate'}; "
            "print(sorted(heavy & set(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_on_hazard_repair_option_repairs_what_a_step_overwrites(suite: pytest.Pytester):
    # test_marked keeps its marker's "raise"; the others run under repair.
    result = suite.runpytest_subprocess("--versionwatch", "--versionwatch-on-hazard", "repair",
                                        "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*FAILED test_suite.py::test_marked*"])


MISUSED = """
import pytest
import torch

def run():
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()

@pytest.mark.versionwatch("warn", True)
def test_two_positional():
    run()

@pytest.mark.versionwatch(strcit=True)
def test_misspelt():
    run()

@pytest.mark.versionwatch("warn", on_hazard="log")
def test_policy_twice():
    run()

@pytest.mark.versionwatch(on_hazard="ignore")
def test_bad_policy():
    run()

@pytest.mark.versionwatch(strict="no")
def test_strict_not_a_bool():
    run()

@pytest.mark.versionwatch("log", strict=True, stop_at_write=False)
def test_right():
    run()
"""


def test_marker_misuse_is_an_error_of_the_test(pytester: pytest.Pytester):
    """Issue #23, item 10: a wrong marker is a clear setup error naming the test, not a
    TypeError from inside the plugin, and a misspelt keyword is not silently ignored."""
    pytester.makepyfile(test_misused=MISUSED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rE")
    result.assert_outcomes(passed=1, errors=5)
    out = result.stdout.str()
    assert "TypeError" not in out and "pytest_plugin.py" not in out, out
    result.stdout.fnmatch_lines_random([
        "*ERROR at setup of test_two_positional*",
        "*test_misused.py::test_two_positional: @pytest.mark.versionwatch takes at most one "
        "positional argument (on_hazard), not 2*",
        "*test_misused.py::test_misspelt: @pytest.mark.versionwatch got an unexpected keyword "
        "argument 'strcit' (did you mean 'strict'?)*",
        "*test_misused.py::test_policy_twice: @pytest.mark.versionwatch got on_hazard twice*",
        "*test_misused.py::test_bad_policy: @pytest.mark.versionwatch: on_hazard='ignore' is "
        "not a valid policy; use one of: raise, warn, log, repair*",
        "*test_misused.py::test_strict_not_a_bool: @pytest.mark.versionwatch: strict='no' is "
        "not True or False*",
    ])


def test_bad_policy_variable_is_a_usage_error(suite: pytest.Pytester,
                                              monkeypatch: pytest.MonkeyPatch):
    """Issue #23, item 9: $VERSIONWATCH_ON_HAZARD as pytest says a bad option, no traceback."""
    monkeypatch.setenv("VERSIONWATCH_ON_HAZARD", "garbage")
    result = suite.runpytest_subprocess("--versionwatch", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: VERSIONWATCH_ON_HAZARD='garbage' is not a valid policy; "
                                 "use one of: raise, warn, log, repair"])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()
    # Without the flag, the marked test alone errs, in one line that names it.
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-k", "marked")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_suite.py::test_marked: VERSIONWATCH_ON_HAZARD="
                                 "'garbage' is not a valid policy*"])
    assert "pytest_plugin.py" not in result.stdout.str()
    # The native helper's variable, as well: refused before any test runs.
    monkeypatch.delenv("VERSIONWATCH_ON_HAZARD")
    monkeypatch.setenv("VERSIONWATCH_NATIVE", "garbage")
    result = suite.runpytest_subprocess("--versionwatch", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: VERSIONWATCH_NATIVE='garbage' is not valid; use auto*"])


OWN_WATCHER = """
import torch
import versionwatch

def test_watches_its_own_model():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    with versionwatch.watch(model, opt) as w:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert w.backward_count == 1
"""


@pytest.mark.parametrize("flag", ["--versionwatch", "--versionwatch-strict"])
def test_a_test_that_watches_its_own_model(pytester: pytest.Pytester, flag: str):
    """Issue #23, item 2: the test's own watch() borrows the model from the plugin's watcher."""
    pytester.makepyfile(test_own=OWN_WATCHER)
    result = pytester.runpytest_subprocess(flag, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


TRAIN = """
import torch
from torch import nn


def test_two_losses_one_step():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(torch.randn(8, 4))
    out.pow(2).mean().backward(retain_graph=True)
    opt.step()
    opt.zero_grad()
    out.abs().mean().backward()
    opt.step()


def test_other_failure():
    assert 1 == 2
"""


def test_fix_option_adds_the_verified_patch_to_the_report(pytester: pytest.Pytester):
    """--versionwatch-fix: the failing test runs again with each patch; the best one shows."""
    path = pytester.makepyfile(test_train=TRAIN)
    before = path.read_text(encoding="utf-8")
    result = pytester.runpytest_subprocess("--versionwatch-fix", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*- versionwatch fix -*",
        "verified: one `opt.step()` after both backwards: *",
        "  checked: the program ran to its end (2 backward(s)), no hazard, no other error; each "
        "optimizer step applies the gradients of the same losses as the program meant; the steps "
        "it merges into one leave the parameters as the program's two did (within 0.0001)",
        "diff --git a/test_train.py b/test_train.py",
        "(1 more verified: `versionwatch fix -m pytest test_train.py::test_two_losses_one_step "
        "--assert=plain` shows them)",
    ])
    out = result.stdout.str()
    assert out.count("- versionwatch fix -") == 1  # not for the test that fails otherwise
    assert path.read_text(encoding="utf-8") == before  # nothing written
