"""The one-host transport: the sender's worker links, the receiver task, the multi-process scheme, worker processes.

It builds on :mod:`asyncsync._core`, :mod:`asyncsync._wire` and :mod:`asyncsync._io` (and the
top-level vocabulary), and never imports :mod:`asyncsync._dist`: the multi-host half sits on
top of this one, not the other way round.
"""
