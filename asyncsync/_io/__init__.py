"""Local I/O: framed non-blocking pipes driven by the event loop, shared-memory segments, slots, off-loop staging.

- :mod:`._framing`: ``Connection``'s length framing; :mod:`._pipe`: ``FramedPipe``, a
  non-blocking ``Connection`` end (write buffer, descriptor passing, ``listen()``);
  :mod:`._queues`: the public ``AsyncQueue`` over a pipe or a ``multiprocessing.Queue``;
- :mod:`._shm`, :mod:`._slots`: shared-memory segments and the sender's slot pool;
- :mod:`._staging`: a worker's staging copies (on :mod:`asyncsync._core._offload`);
  :mod:`._loop_thread`: an event loop in a thread of its own.

These modules touch file descriptors, memory and devices but know nothing about workers or
hosts. They may import the top-level vocabulary, :mod:`asyncsync._core` and
:mod:`asyncsync._wire`; never :mod:`asyncsync._local` or :mod:`asyncsync._dist`.
"""
