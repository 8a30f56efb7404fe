"""Strict mode: each write to memory that a live graph saved, seen at the line that makes it.

It owns the records kept of every tensor autograd saves (``records``), the write
interception that matches each write against them before it happens (``writes``),
each thread's step, forward and module calls (``thread``), strict mode's entries on
PyTorch's saved-tensor hooks stack (``hookstack``), and their start and end for a
watcher (``mode``). It sits below the predictor, which reads its records, and
declares the faces it needs of a watcher and a repairer (``StrictOwner``,
``StrictRepairer``) itself.
"""
