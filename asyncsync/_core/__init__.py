"""The delivery core both schemes share: no I/O here.

Transports (the local worker links, the remote host table) move bytes and messages and
report what happened to these objects; the promises live here once:

- :mod:`._acks`: per-worker delivery state, acks per connection, waits, statistics rows;
- :mod:`._deadline`: per-call deadlines and racing work against a stop condition;
- :mod:`._offload`: the one way blocking work leaves the event loop;
- :mod:`._source`: what a send carries, resolved and validated once per source;
- :mod:`._layout`, :mod:`._weights`: per-dtype buckets and the weights adapters;
- :mod:`._ownership`: slot owner sets and buffer roles; :mod:`._signal`: the change signal waiters re-check on.

It may import the top-level vocabulary (``_errors``, ``_stats``, ``_options``) and nothing from
:mod:`asyncsync._wire`, :mod:`asyncsync._io`, :mod:`asyncsync._local` or :mod:`asyncsync._dist`.
"""
