"""Shared-memory segments backed by ``memfd_create``.

A segment has no name in ``/dev/shm``: it lives as long as some process maps it or
holds its file descriptor, so nothing is left behind after ``aclose()`` or a crash
(even SIGKILL). Descriptors travel to workers over the channel's Unix socket.
"""

from __future__ import annotations

import mmap
import os
import warnings

import torch

__all__ = ["Segment"]


class Segment:
    """One mapped shared-memory buffer, exposed as a uint8 tensor ``buf``."""

    def __init__(self, nbytes: int, fd: int | None = None, *, populate: bool = True) -> None:
        self.nbytes = nbytes
        owner = fd is None
        if fd is None:
            fd = os.memfd_create("asyncsync", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, max(nbytes, 1))
            except BaseException:
                os.close(fd)
                raise
        self.fd: int | None = fd
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, max(nbytes, 1), flags=flags)
        except BaseException:
            if owner:
                os.close(fd)
            raise
        self.buf = torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> Segment:
        """Map a segment received from a peer; the descriptor is closed once mapped."""
        seg = cls(nbytes, fd)
        seg.close_fd()
        return seg

    def share(self, nbytes: int) -> torch.Tensor:
        """A new uint8 tensor over the first *nbytes*, with a storage object of its own.

        Like ``buf`` it keeps the mapping alive while something views it; its storage can
        be handed over (``_swap_data_ptr_``) without touching ``buf``'s.
        """
        if self._mmap is None:
            raise ValueError("the segment is closed")
        return torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes)

    def close_fd(self) -> None:
        """Close the descriptor; the mapping stays valid."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self, unmap: bool = False) -> None:
        """Drop the descriptor and this object's reference to the mapping.

        Tensors that still view the buffer (a model pointing at it) keep the mapping
        alive until they are garbage-collected: that is how a worker keeps its last
        weights after the sender is gone. ``unmap=True`` unmaps at once; only the
        owner of every view (the sender, for its slots) may ask for that, since
        ``torch.frombuffer`` views do not pin the mapping against ``mmap.close()``.
        """
        self.close_fd()
        self.buf = torch.empty(0, dtype=torch.uint8)
        mm, self._mmap = self._mmap, None
        if mm is not None and unmap:
            mm.close()

    def __del__(self) -> None:
        if getattr(self, "fd", None) is not None:
            warnings.warn("unclosed asyncsync shared-memory segment", ResourceWarning, stacklevel=1)
            try:
                self.close()
            except Exception:
                pass
