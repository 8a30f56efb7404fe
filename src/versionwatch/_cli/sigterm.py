"""How a ``versionwatch run`` ends: SIGTERM, ``os._exit``, and threads after ``__main__``.

SIGTERM: torchrun stops the other ranks with SIGTERM when one rank fails; a
plain program dies of it at once, and its report would be lost. While the
guard is installed, SIGTERM first calls ``on_term`` (which writes the outputs),
then restores the default action and sends the signal again, so the process
ends exactly as the plain one does (killed by signal 15).

A Python signal handler runs only when the main thread comes back to Python,
which a rank blocked in a collective (gloo, NCCL) may never do. So the C-level
handler's wakeup byte (``signal.set_wakeup_fd``) is also read by a thread,
which does the same from there.

``os._exit(n)``: it skips everything Python does on the way out. While the
guard is installed (with ``on_exit``), ``os._exit`` is a wrapper that calls
``on_exit(n)`` first, then the real ``os._exit(n)``; only in this process, not
in a forked child (multiprocessing's children end with ``os._exit``).

What no guard can cover: SIGKILL (and any other signal whose default action
ends the process, except SIGTERM and the SIGINT that Python turns into
``KeyboardInterrupt``), a crash of the interpreter or of native code (a
segfault, an abort), ``posix._exit`` called directly, and an ``_exit`` from C.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Collection
from types import FrameType
from typing import Any, Callable

from versionwatch._runtime import Patch

# os._exit as the interpreter made it, whatever is patched later.
_REAL_EXIT = os._exit


def threads_left(before: Collection[threading.Thread] = ()) -> bool:
    """Whether a thread that Python waits for at exit (not a daemon) still runs.

    Threads in ``before`` (those that ran before the program began) are not the
    program's.
    """
    me = threading.current_thread()
    return any(t is not me and t not in before and not t.daemon and t.is_alive()
               for t in threading.enumerate())


class TermGuard:
    """Calls ``on_term()`` once on SIGTERM, then lets SIGTERM end the process.

    With ``on_exit``, ``os._exit(n)`` in this process calls ``on_exit(n)`` first.
    The first of them to come ends the process: the other waits for it.
    """

    def __init__(self, on_term: Callable[[], None],
                 on_exit: Callable[[int], None] | None = None) -> None:
        self._on_term = on_term
        self._on_exit = on_exit
        # Reentrant: SIGTERM's handler may run on the thread that is inside os._exit.
        # Public: whoever writes what on_term or on_exit would write holds it too.
        self.lock = threading.RLock()
        self._fired = False
        self._installed = False
        self._pipe: tuple[int, int] | None = None
        self._old_fd = -1
        self._thread: threading.Thread | None = None
        self._exit_patch: Patch | None = None

    def install(self) -> None:
        """Take over os._exit, and SIGTERM unless the program or its host handles it."""
        if self._on_exit is not None and self._exit_patch is None:
            self._exit_patch = Patch(os, "_exit", self._exit_wrapper(os._exit))
            self._exit_patch.apply()
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, self._handler)
        self._installed = True
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return
        if old != -1:  # someone's event loop reads it: leave it theirs
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._pipe = (r, w)
        self._thread = threading.Thread(target=self._watch, args=(r,), daemon=True,
                                        name="versionwatch-sigterm")
        self._thread.start()

    def close(self) -> None:
        """Give SIGTERM back to its default action, os._exit back, and stop the thread."""
        if self._exit_patch is not None:
            if os._exit is self._exit_patch.new:  # not replaced by the program since
                self._exit_patch.restore()
            self._exit_patch = None
        if not self._installed:
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self._pipe is not None:
            r, w = self._pipe
            self._pipe = None
            try:
                prev = signal.set_wakeup_fd(-1)
                if prev not in (w, -1):  # replaced meanwhile: put that one back
                    signal.set_wakeup_fd(prev)
            except ValueError:
                pass
            os.close(w)  # the thread's read returns b"": it ends
            if self._thread is not None:
                self._thread.join(timeout=5)
            os.close(r)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Called by a program's own handler that chains to the one it replaced
        # (``prev = getsignal(SIGTERM)``): unwatched that was SIG_DFL, not
        # callable, so the program goes on as it chose.
        if signal.getsignal(signal.SIGTERM) != self._handler:
            return
        self._fire(main=True)

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            if (signal.SIGTERM in data
                    and signal.getsignal(signal.SIGTERM) == self._handler):
                self._fire(main=False)

    def _exit_wrapper(self, real: Callable[[int], Any]) -> Callable[[int], Any]:
        pid = os.getpid()

        @functools.wraps(real)
        def _exit(status: int) -> Any:
            # A forked child's exit is its own; a status os._exit refuses, refused as ever.
            if os.getpid() == pid and isinstance(status, int) and self._on_exit is not None:
                with self.lock:  # SIGTERM's route, or another os._exit, ends it first
                    if not self._fired:
                        self._fired = True
                        try:
                            self._on_exit(status)
                        except BaseException:  # the exit must happen, whatever we failed
                            pass
                    return real(status)
            return real(status)

        return _exit

    def _fire(self, main: bool) -> None:
        # Held until the process dies: the other route waits here, not in the program.
        with self.lock:
            if self._fired:
                return
            self._fired = True
            try:
                self._on_term()
            finally:
                _die_of_sigterm(main)


def _die_of_sigterm(main: bool) -> None:
    if main:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        # signal.signal works on the main thread only; the main thread may be
        # stuck in C, so set the default action through the C library.
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            libc.signal(int(signal.SIGTERM), 0)  # SIG_DFL
        except (OSError, AttributeError):
            _REAL_EXIT(128 + int(signal.SIGTERM))  # as a shell reports the signal
    os.kill(os.getpid(), signal.SIGTERM)
