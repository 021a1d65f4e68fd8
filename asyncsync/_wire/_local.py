"""The local plane: a sender and its workers, over one Unix socket per worker.

Sender -> worker (:data:`ToWorker`): :class:`Setup` (once per connection), :class:`MapSlots`
(the slots' file descriptors follow), :class:`Receive` (at most one outstanding),
:class:`Mailbox` (to a polled worker; the mailbox's and the wake's descriptors follow, and
it replaces ``Receive``), :class:`Stop`. Worker -> sender (:data:`FromWorker`):
:class:`Hello`, :class:`Poll` (this worker polls), :class:`Ack`, :class:`Staged` (manual
commits), :class:`Bye` (its weights already detached from every shared slot). Each
direction's decoder refuses a frame of any other message, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from ._codec import Frame, decoder, encode
from ._messages import Ack, Bye, Hello, Mailbox, MapSlots, Poll, Receive, Setup, Staged, Stop, assert_never

__all__ = ["Ack", "Bye", "FromWorker", "Hello", "Mailbox", "MapSlots", "Poll", "Receive", "Setup", "Staged", "Stop", "ToWorker"]
__all__ += ["assert_never", "decode_from_worker", "decode_to_worker", "encode"]

ToWorker = Setup | MapSlots | Receive | Mailbox | Stop
FromWorker = Hello | Poll | Ack | Staged | Bye

decode_to_worker: Callable[[Frame], ToWorker] = decoder(get_args(ToWorker), "a sender never sends this message")
decode_from_worker: Callable[[Frame], FromWorker] = decoder(get_args(FromWorker), "a worker never sends this message")
