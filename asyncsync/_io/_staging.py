"""Copies that stage weights on a worker's device without stalling its event loop.

CPU copies above a threshold run in the staging thread (torch releases the GIL while
copying), under :mod:`asyncsync._core._offload`'s rule: a cancelled caller leaves at once,
the copy runs to its end, the next one starts after it, what the copy writes is released
only when it has ended (the caller's *keep* / *release*), and :meth:`Stager.close` waits
for it before anything it reads or writes is unregistered or unmapped.
CUDA copies are issued non-blocking on a side stream (from page-locked memory when the
source is registered with CUDA) and their completion is awaited by polling a CUDA event
from the loop: the loop thread never calls ``torch.cuda.synchronize()``. A cancelled
caller leaves at once there too; *release* comes once the event has fired.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .._core._offload import Offload

__all__ = ["Stager", "copy_tensors", "stream_done"]

T = TypeVar("T")

THREAD_BYTES = 1 << 20
_POLL_S = 0.0002
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def _cudart_calls() -> tuple[Callable[[int, int, int], int], Callable[[int], int], str]:
    """``cudaHostRegister`` / ``cudaHostUnregister``, through ctypes when the process has
    the CUDA runtime loaded (torch loads it globally): a ctypes call releases the GIL, so
    pinning hundreds of MB in the staging thread leaves the loop running. torch's own
    binding holds the GIL; it is the fallback."""
    try:
        lib = ctypes.CDLL(None)
        register, unregister = lib.cudaHostRegister, lib.cudaHostUnregister
    except (AttributeError, OSError):
        rt = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        return (lambda p, n, f: int(rt.cudaHostRegister(p, n, f))), (lambda p: int(rt.cudaHostUnregister(p))), "torch.cuda.cudart"
    register.argtypes, register.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], ctypes.c_int
    unregister.argtypes, unregister.restype = [ctypes.c_void_p], ctypes.c_int
    return register, unregister, "ctypes"


_cudart: tuple[Callable[[int, int, int], int], Callable[[int], int], str] | None = None


def cudart() -> tuple[Callable[[int, int, int], int], Callable[[int], int], str]:
    """``(register, unregister, how)``, resolved once."""
    global _cudart
    if _cudart is None:
        _cudart = _cudart_calls()
    return _cudart


def copy_tensors(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], non_blocking: bool = False) -> None:
    """``dst[i].copy_(src[i])`` for all i, fused where torch can."""
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # what ``no_grad`` does, without its context object (hot path)
    try:
        try:
            torch._foreach_copy_(list(dst), list(src), non_blocking=non_blocking)
        except (RuntimeError, TypeError):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=non_blocking)
    finally:
        torch._C._set_grad_enabled(grad)


def _copy_inference(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """:func:`copy_tensors` into inference tensors (inference mode is per thread)."""
    with torch.inference_mode():
        copy_tensors(dst, src)


async def stream_done(stream: Any) -> None:
    """Until the work queued so far on CUDA *stream* ran: an event polled from the loop,
    which never synchronizes a stream."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    await _event_done(event)


async def _event_done(event: Any) -> None:
    while not event.query():
        await asyncio.sleep(_POLL_S)


async def _release_after(event: Any, release: Callable[[], None]) -> None:
    try:
        await _event_done(event)
    finally:
        release()


class Stager:
    """Runs staging copies for one receiver; ``close()`` joins its thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._thread = Offload("asyncsync-stage")
        self._stream: torch.cuda.Stream | None = None
        self._registered: dict[int, int] = {}
        self._finishing: set[asyncio.Task[None]] = set()  # device copies whose caller left

    async def copy(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        nbytes: int,
        *,
        inference: bool = False,
        keep: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Copy *src* into *dst* off the event loop; returns once the data is in place.

        *inference*: *dst* holds inference tensors, written only inside ``torch.inference_mode()``.
        Cancelled before the copy ended, it calls *keep* at once and *release* on the loop
        once the copy has ended (then *dst* and *src* may be reused or unmapped).
        """
        if self.device.type == "cuda":
            await self._copy_cuda(dst, src, inference, keep, release)
        else:
            await self.run(nbytes, _copy_inference if inference else copy_tensors, dst, src, keep=keep, release=release)

    async def run(
        self,
        nbytes: int,
        fn: Callable[..., T],
        *args: Any,
        keep: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
        discard: Callable[[T], None] | None = None,
    ) -> T:
        """``fn(*args)``: inline when small, in the staging thread when *nbytes* is large
        (*keep*, *release*, *discard*: as for :meth:`Offload.run`)."""
        return await self._thread.run(fn, *args, inline=nbytes < THREAD_BYTES, keep=keep, release=release, discard=discard)

    async def pin(self, buffer: torch.Tensor) -> None:
        """Page-lock a shared CPU buffer so host-to-device copies are truly asynchronous
        (once per buffer; in the staging thread when large: registering 400 MB takes tens
        of milliseconds, which the worker's loop must not spend)."""
        if self.device.type != "cuda" or buffer.numel() == 0 or buffer.data_ptr() in self._registered:
            return
        await self.run(buffer.numel() * buffer.element_size(), self._register, buffer)

    def _register(self, buffer: torch.Tensor) -> None:
        ptr = buffer.data_ptr()
        if ptr in self._registered:
            return
        with torch.cuda.device(self.device):  # this thread's context is the worker's device's
            err = cudart()[0](ptr, buffer.numel() * buffer.element_size(), _HOST_REGISTER_PORTABLE)
        if err == 0:
            self._registered[ptr] = buffer.numel()  # recorded here: a cancelled pin() still unregisters at close

    def unpin(self, buffer: torch.Tensor) -> None:
        ptr = buffer.data_ptr()
        if self._registered.pop(ptr, None) is not None:
            with torch.cuda.device(self.device):
                cudart()[1](ptr)

    async def _copy_cuda(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        inference: bool,
        keep: Callable[[], None] | None,
        release: Callable[[], None] | None,
    ) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        stream = self._stream
        # The staging buffers may still be read by kernels queued on the compute stream.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode(inference):
            copy_tensors(dst, src, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        try:
            await _event_done(event)
        except BaseException:
            if not event.query():  # type: ignore[no-untyped-call]  # the copy goes on without its caller: the Offload rule
                if keep is not None:
                    keep()
                if release is not None:
                    task = asyncio.get_running_loop().create_task(_release_after(event, release))
                    self._finishing.add(task)
                    task.add_done_callback(self._finishing.discard)
            raise

    def close(self) -> None:
        self._thread.close()  # a copy or registration still running ends first
        if self._stream is not None:
            # a device copy whose caller left may still read a slot: done before it is unregistered
            self._stream.synchronize()
        for ptr in list(self._registered):
            with torch.cuda.device(self.device):
                cudart()[1](ptr)
        self._registered.clear()
