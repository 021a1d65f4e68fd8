"""The control plane: the multi-host trainer and its relays, over one TCP connection per host.

Trainer -> relay (:data:`ToRelay`): :class:`Challenge`, then :class:`Welcome` (the
handshake), :class:`Setup` (the wire layout; or :class:`Bye`, refused), then
:class:`Group`, :class:`Transfer`, :class:`Stop`, or :class:`Bye` (dropped). Relay ->
trainer (:data:`FromRelay`): :class:`Auth` (the handshake), then :class:`Beat` (the layout
fits) or :class:`Bye`, then :class:`Ack` and :class:`Lost` for its local workers, and
:class:`Bye` when it leaves. ``Beat`` goes both ways. A worker that attaches by address
runs the same handshake (:data:`Handshake`) before its socket turns local. Each decoder
refuses a frame of any other message, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from ._codec import HEADER_BYTES, Frame, decoder, encode, payload_length
from ._messages import Ack, Auth, Beat, Bye, Challenge, Group, Lost, Setup, Stop, Transfer, Welcome, assert_never

__all__ = ["Ack", "Auth", "Beat", "Bye", "Challenge", "Group", "Lost", "Setup", "Stop", "Transfer", "Welcome"]
__all__ += ["HEADER_BYTES", "ControlMessage", "FromRelay", "Handshake", "ToRelay", "assert_never", "encode", "payload_length"]
__all__ += ["decode_from_relay", "decode_handshake", "decode_to_relay"]

ToRelay = Challenge | Welcome | Setup | Group | Transfer | Stop | Bye | Beat
FromRelay = Auth | Beat | Ack | Lost | Bye
ControlMessage = ToRelay | FromRelay
Handshake = Challenge | Auth | Welcome | Bye

decode_to_relay: Callable[[Frame], ToRelay] = decoder(get_args(ToRelay), "a trainer never sends this message")
decode_from_relay: Callable[[Frame], FromRelay] = decoder(get_args(FromRelay), "a relay never sends this message")
decode_handshake: Callable[[Frame], Handshake] = decoder(get_args(Handshake), "not a handshake message")
