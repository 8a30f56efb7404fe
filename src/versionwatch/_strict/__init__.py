"""Strict mode: each write to memory that a live graph saved, seen at the line that makes it.

It owns the records kept of every tensor autograd saves (``records``), the write
interception that matches each write against them before it happens (``writes``),
each thread's step, forward and module calls (``thread``), strict mode's entries on
PyTorch's saved-tensor hooks stack (``hookstack``), the opt-in samples of saved
bytes compared before backward (``fingerprint``), and their start and end for a
watcher (``mode``). It sits below the predictor, which reads its records, and
declares the faces it needs of a watcher and a repairer (``StrictOwner``,
``StrictRepairer``) itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch._strict.checkpoint import checkpoint_hazard as checkpoint_hazard
    from versionwatch._strict.checkpoint import checkpoint_record as checkpoint_record
    from versionwatch._strict.fingerprint import FINGERPRINT_ANCHOR as FINGERPRINT_ANCHOR
    from versionwatch._strict.fingerprint import FINGERPRINTS as FINGERPRINTS
    from versionwatch._strict.fingerprint import fingerprint_changed as fingerprint_changed
    from versionwatch._strict.mode import attach as attach
    from versionwatch._strict.records import RECORDS as RECORDS
    from versionwatch._strict.records import SavedRecord as SavedRecord
    from versionwatch._strict.records import name_modules as name_modules
    from versionwatch._strict.records import output_of as output_of
    from versionwatch._strict.records import saved_line as saved_line
    from versionwatch._strict.records import strict_message as strict_message
    from versionwatch._strict.records import unpack as unpack
    from versionwatch._strict.thread import THREAD as THREAD
    from versionwatch._strict.thread import begin_step as begin_step
    from versionwatch._strict.thread import end_step as end_step
    from versionwatch._strict.writes import on_write as on_write

_WHERE = {
    "attach": "versionwatch._strict.mode",
    "begin_step": "versionwatch._strict.thread",
    "checkpoint_hazard": "versionwatch._strict.checkpoint",
    "checkpoint_record": "versionwatch._strict.checkpoint",
    "end_step": "versionwatch._strict.thread",
    "FINGERPRINT_ANCHOR": "versionwatch._strict.fingerprint",
    "fingerprint_changed": "versionwatch._strict.fingerprint",
    "FINGERPRINTS": "versionwatch._strict.fingerprint",
    "name_modules": "versionwatch._strict.records",
    "on_write": "versionwatch._strict.writes",
    "output_of": "versionwatch._strict.records",
    "RECORDS": "versionwatch._strict.records",
    "saved_line": "versionwatch._strict.records",
    "SavedRecord": "versionwatch._strict.records",
    "strict_message": "versionwatch._strict.records",
    "THREAD": "versionwatch._strict.thread",
    "unpack": "versionwatch._strict.records",
}

__getattr__ = lazy_names(__name__, _WHERE)
