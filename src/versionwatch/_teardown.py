"""SIGTERM during ``versionwatch run``: write the report, then die of SIGTERM.

torchrun stops the other ranks with SIGTERM when one rank fails; a plain
program dies of it at once, and its report would be lost. While the guard is
installed, SIGTERM first calls ``on_term`` (which writes the outputs), then
restores the default action and sends the signal again, so the process ends
exactly as the plain one does (killed by signal 15).

A Python signal handler runs only when the main thread comes back to Python,
which a rank blocked in a collective (gloo, NCCL) may never do. So the C-level
handler's wakeup byte (``signal.set_wakeup_fd``) is also read by a thread,
which does the same from there.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Callable


class TermGuard:
    """Calls ``on_term()`` once on SIGTERM, then lets SIGTERM end the process."""

    def __init__(self, on_term: Callable[[], None]) -> None:
        self._on_term = on_term
        self._lock = threading.Lock()
        self._fired = False
        self._installed = False
        self._pipe: tuple[int, int] | None = None
        self._old_fd = -1
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        """Take over SIGTERM, unless the program or its host handles it already."""
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
        """Give SIGTERM back to its default action and stop the thread."""
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

    def _fire(self, main: bool) -> None:
        # Held until the process dies: the other route waits here, not in the program.
        with self._lock:
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
            os._exit(128 + int(signal.SIGTERM))  # as a shell reports the signal
    os.kill(os.getpid(), signal.SIGTERM)
