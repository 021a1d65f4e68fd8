"""The user-facing schemes, in torchrl's vocabulary, on one base (:mod:`._base`).

They sit above both transports (:mod:`asyncsync._local`, :mod:`asyncsync._dist`) and build
a :class:`~asyncsync._core._sender.Sender` over one of them, a receiver, or a relay.
"""
