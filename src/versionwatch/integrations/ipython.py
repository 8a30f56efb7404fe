"""IPython and Jupyter: ``%load_ext versionwatch`` and the ``%%versionwatch`` cell magic.

``%load_ext versionwatch`` watches every module and optimizer the kernel runs from
then on, as :func:`versionwatch.watch_all` does; a hazard's report is printed in
the output of the cell that hit it (``on_hazard="warn"`` unless
``$VERSIONWATCH_ON_HAZARD`` says otherwise). ``%unload_ext versionwatch`` removes
every hook. ``%%versionwatch [--strict] [--on-hazard POLICY]`` watches one cell.

Lines in a cell read as IPython writes them, ``Cell In[5], line 3``: the kernel
compiles each cell under a temporary file name, and IPython's compiler keeps which
name is which cell. ``import versionwatch`` never imports IPython; these entry
points import it when they are called.
"""

from __future__ import annotations

import shlex
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO

from versionwatch._report import CELL_LOOKUPS, Report, register_cell

if TYPE_CHECKING:
    from versionwatch._watch import Policy

__all__ = ["load_ipython_extension", "unload_ipython_extension"]

DEFAULT_POLICY: Literal["warn"] = "warn"
USAGE = "usage: %%versionwatch [--strict] [--on-hazard raise|warn|log|repair]"

Lookup = Callable[[str], "int | None"]


class Shell(Protocol):
    """What the extension uses of IPython's ``InteractiveShell``."""

    execution_count: int

    def register_magic_function(self, func: Callable[..., object], magic_kind: str = ...,
                                magic_name: str | None = ...) -> None: ...

    def run_cell(self, raw_cell: str, store_history: bool = ...) -> object: ...


# The extension's own state: the kernel's shell, its watcher and its cell lookup.
_LOADED: dict[str, Any] = {}


def _cell_lookup(shell: object) -> Lookup:
    """``filename -> In[n]``, read from the shell's compiler when asked.

    IPython 8 and 9 keep ``compile._filename_map`` (the temporary file name a cell
    was compiled under -> its execution count); a version without it maps nothing,
    and reports then show the file name.
    """

    def lookup(filename: str) -> int | None:
        compiler = getattr(shell, "compile", None)
        names = getattr(compiler, "_filename_map", None)
        if isinstance(names, dict):
            number = names.get(filename)
            return number if isinstance(number, int) and not isinstance(number, bool) else None
        # Else the public face of the same map: ("Cell", "In[5]") for a cell's file.
        shown = getattr(compiler, "format_code_name", None)
        try:
            label = shown(filename) if callable(shown) else None
        except Exception:  # a compiler of another kind: no cells to name
            return None
        if isinstance(label, tuple) and len(label) == 2 and str(label[1]).startswith("In["):
            digits = str(label[1])[3:-1]
            return int(digits) if digits.isdigit() else None
        return None

    return lookup


def _add_lookup(shell: object) -> Lookup:
    lookup = _cell_lookup(shell)
    CELL_LOOKUPS.append(lookup)
    return lookup


def _remove_lookup(lookup: Lookup) -> None:
    # By identity: another shell's lookup (a second kernel in one process) stays.
    for i, other in enumerate(CELL_LOOKUPS):
        if other is lookup:
            del CELL_LOOKUPS[i]
            return


def _show_reports(original: Callable[..., None]) -> Callable[..., None]:
    """``warnings.showwarning`` that prints a versionwatch report as its text, once.

    The default format would put the kernel's temporary file name and the line
    before the report, which names its lines as IPython does; any other warning
    goes to ``original``.
    """
    from versionwatch._report import InplaceHazardWarning

    def showwarning(message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
        if issubclass(category, InplaceHazardWarning):
            stream = file if file is not None else sys.stderr
            try:
                stream.write(f"{message}\n")
            except (OSError, AttributeError):  # no stream to write to: as warnings does
                pass
            return
        original(message, category, filename, lineno, file, line)

    return showwarning


def _warn(report: Report) -> None:
    """The ``warn`` policy in a kernel: an :class:`InplaceHazardWarning` at the backward's
    line, shown each time.

    ``warnings.warn`` keeps a registry in the cell's namespace, and shows a warning again
    only if its text differs: a cell run again with the same bug would print nothing.
    Filters (``"error"``, ``"ignore"``, ``"once"``) apply as to any warning.
    """
    from versionwatch._report import InplaceHazardWarning

    site = report.backward_site
    warnings.warn_explicit(str(report), InplaceHazardWarning,
                           site.file if site is not None else "<versionwatch>",
                           site.line if site is not None else 0, registry=None)


def _policy(policy: str) -> Policy:
    """``policy`` as a kernel runs it: ``warn`` shown each time, the others as they are."""
    return _warn if policy == "warn" else policy  # type: ignore[return-value]


def _reports_shown() -> Callable[[], None]:
    """Show reports as their text until the returned function is called."""
    original = warnings.showwarning
    ours = warnings.showwarning = _show_reports(original)

    def restore() -> None:
        if warnings.showwarning is ours:  # else someone wrapped it since: theirs stays
            warnings.showwarning = original

    return restore


def load_ipython_extension(ip: Shell) -> None:
    """``%load_ext versionwatch``: watch everything the kernel runs from now on.

    Loading twice is harmless: the second load does nothing.

    Example:
        >>> from IPython.testing.globalipapp import get_ipython  # doctest: +SKIP
        >>> ip = get_ipython()                                   # doctest: +SKIP
        >>> ip.run_line_magic("load_ext", "versionwatch")        # doctest: +SKIP
        >>> ip.run_line_magic("unload_ext", "versionwatch")      # doctest: +SKIP
    """
    from IPython.core.error import UsageError

    from versionwatch._watch import env_problem, resolve_policy, watch_all

    problem = env_problem()
    if problem is not None:  # one line in the cell's output, not our traceback
        raise UsageError(f"versionwatch: {problem}")

    def versionwatch(line: str, cell: str) -> None:
        """``%%versionwatch [--strict] [--on-hazard POLICY]``: watch this cell only."""
        _cell_magic(ip, line, cell)

    ip.register_magic_function(versionwatch, magic_kind="cell", magic_name="versionwatch")
    if _LOADED.get("watcher") is not None and not _LOADED["watcher"].closed:
        return
    lookup = _add_lookup(ip)
    try:
        watcher = watch_all(on_hazard=_policy(str(resolve_policy(DEFAULT_POLICY))))
    except BaseException:
        _remove_lookup(lookup)
        raise
    _LOADED.update(shell=ip, watcher=watcher, lookup=lookup, restore=_reports_shown())


def unload_ipython_extension(ip: Shell) -> None:
    """``%unload_ext versionwatch``: remove every hook and patch the extension made.

    Example:
        >>> ip.run_line_magic("unload_ext", "versionwatch")  # doctest: +SKIP
    """
    watcher, lookup = _LOADED.pop("watcher", None), _LOADED.pop("lookup", None)
    restore = _LOADED.pop("restore", None)
    _LOADED.pop("shell", None)
    if restore is not None:
        restore()
    try:
        if watcher is not None:
            watcher.close()
    finally:
        if lookup is not None:
            _remove_lookup(lookup)


def _parse(line: str) -> tuple[bool, str]:
    """``(strict, policy)`` from the magic's line; a bad one raises ``UsageError``."""
    from IPython.core.error import UsageError

    from versionwatch._watch import POLICIES

    try:
        words = shlex.split(line)
    except ValueError as err:
        raise UsageError(f"%%versionwatch: {err}; {USAGE}") from None
    strict, policy = False, str(DEFAULT_POLICY)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--strict":
            strict = True
        elif word == "--on-hazard" or word.startswith("--on-hazard="):
            if "=" in word:
                policy = word.split("=", 1)[1]
            elif i + 1 < len(words):
                i += 1
                policy = words[i]
            else:
                raise UsageError(f"%%versionwatch: --on-hazard needs a value; {USAGE}")
            if policy not in POLICIES:
                raise UsageError(f"%%versionwatch: --on-hazard {policy!r} is not a policy; "
                                 f"use one of: {', '.join(POLICIES)}")
        else:
            raise UsageError(f"%%versionwatch: unknown option {word!r}; {USAGE}")
        i += 1
    return strict, policy


def _cell_magic(shell: Shell, line: str, cell: str) -> None:
    """Run ``cell`` watched, as ``line``'s options say."""
    from IPython.core.error import UsageError

    from versionwatch._watch import env_problem, resolve_policy, watch_all

    strict, policy = _parse(line)
    problem = env_problem()
    if problem is not None:
        raise UsageError(f"%%versionwatch: {problem}")
    lookup = None if _LOADED.get("lookup") is not None else _add_lookup(shell)
    # The body runs as a cell of its own (IPython compiles it under a file name of its
    # own and shows its last value), numbered with the execution count IPython has
    # moved on to: its lines belong to this cell, In[n] as the notebook shows it.
    names = getattr(getattr(shell, "compile", None), "_filename_map", None)
    outer = _calling_cell(names)
    inner = getattr(shell, "execution_count", None)
    renumber = None
    if isinstance(names, dict) and outer is not None and inner != outer:

        def renumber(filename: str) -> int | None:
            return outer if names.get(filename) == inner else None

        CELL_LOOKUPS.insert(0, renumber)
    restore = None if _LOADED.get("restore") is not None else _reports_shown()
    try:
        chosen = _policy(str(resolve_policy(policy)))  # type: ignore[arg-type]
        with watch_all(on_hazard=chosen, strict=strict):
            shell.run_cell(cell, store_history=False)
    finally:
        if restore is not None:
            restore()
        if renumber is not None:
            # Reports kept from this cell go on naming it once the next cell takes `inner`.
            for filename, number in list(names.items()):  # type: ignore[union-attr]
                if number == inner:
                    register_cell(filename, outer)  # type: ignore[arg-type]
            _remove_lookup(renumber)
        if lookup is not None:
            _remove_lookup(lookup)


def _calling_cell(names: object) -> int | None:
    """The number of the cell whose code called the magic: its frame's file is a cell's."""
    if not isinstance(names, dict):
        return None
    frame = sys._getframe(1)
    while frame is not None:
        number = names.get(frame.f_code.co_filename)
        if isinstance(number, int):
            return number
        frame = frame.f_back  # type: ignore[assignment]
    return None
