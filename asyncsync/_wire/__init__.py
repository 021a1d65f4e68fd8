"""The wire format: message types and their binary codec (struct headers, no pickle from a peer).

Pure data in, bytes out and back, so both the local and the multi-host transports speak it.
It may import the top-level vocabulary (``_errors``) and :mod:`asyncsync._core` only; never
:mod:`asyncsync._io`, :mod:`asyncsync._local` or :mod:`asyncsync._dist`.
"""
