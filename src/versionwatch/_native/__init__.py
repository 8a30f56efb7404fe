"""The optional native helper (C++, torch's ``cpp_extension``): an exact saved-tensor check and
fast version reads.

It owns loading and deciding the helper (``loader``), building it with a build that
cannot hang (``build``), its self-test against the Python predictor (``selftest``)
and its source (``native.cpp``, shipped in the wheel). Without a compiler everything
runs in Python with the same results; what was decided lives in the leaf
``_native_state``, read at every backward.
"""
