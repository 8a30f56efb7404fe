"""What to do on a hazard: the ``on_hazard`` policy, its environment override, and the
check of our environment variables before anything is watched."""

from __future__ import annotations

import os
from typing import Callable, Literal, Union

from versionwatch._native import mode_problem
from versionwatch._report import Report

Policy = Union[Literal["raise", "warn", "log", "repair"], Callable[[Report], object]]
POLICIES = ("raise", "warn", "log", "repair")
ENV_VAR = "VERSIONWATCH_ON_HAZARD"


def env_problem() -> str | None:
    """What is wrong with ``$VERSIONWATCH_ON_HAZARD`` or ``$VERSIONWATCH_NATIVE``, in one
    line; ``None`` if nothing.

    The command line checks them before it runs anything (exit status 2, as for a bad
    ``--on-hazard``); ``watch()`` raises the line as a ``ValueError``, because a watcher
    would otherwise meet the bad value only at its first backward, where it cannot say so.
    """
    env = os.environ.get(ENV_VAR)
    if env and env not in POLICIES:
        return f"{ENV_VAR}={env!r} is not a valid policy; use one of: {', '.join(POLICIES)}"
    return mode_problem()


def resolve_policy(on_hazard: Policy) -> Policy:
    """The effective policy: ``$VERSIONWATCH_ON_HAZARD`` wins over the argument."""
    problem = env_problem()
    if problem is not None:
        raise ValueError(problem)
    env = os.environ.get(ENV_VAR)
    if env:
        return env  # type: ignore[return-value]
    if callable(on_hazard):
        return on_hazard
    if on_hazard not in POLICIES:
        raise ValueError(
            f"on_hazard={on_hazard!r} is not a valid policy; use one of: "
            f"{', '.join(POLICIES)}, or a callable that takes a Report"
        )
    return on_hazard
