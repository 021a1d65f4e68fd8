"""Local I/O: framed non-blocking pipes driven by the event loop, shared-memory segments, slots, off-loop staging.

These modules touch file descriptors, memory and devices but know nothing about workers or
hosts. They may import the top-level vocabulary, :mod:`asyncsync._core` and
:mod:`asyncsync._wire`; never :mod:`asyncsync._local` or :mod:`asyncsync._dist`.
"""
