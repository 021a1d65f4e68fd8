"""Another program busy in /dev/shm, for the leak check's tests: ``python tests/_shm_neighbour.py FD [--detach]``.

It takes one command a line on the socket *FD* and answers each with ``ok PID NAMES`` once done:
``make`` removes what it made before and makes three entries named as others name theirs
(a multiprocessing semaphore's, torch's with its own pid, a ``SharedMemory``'s): one it
maps, one it holds open, one it closes at once. It removes what it made and exits at
``end`` or when the socket closes. With ``--detach`` it forks and the first process
exits: the one that goes on is no descendant of the test's process.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import sys

SHM = "/dev/shm"


def main() -> None:
    conn = socket.socket(fileno=int(sys.argv[1]))
    if "--detach" in sys.argv:
        if os.fork():
            os._exit(0)
        os.setsid()
    made: list[str] = []
    held: list[mmap.mmap | int] = []
    with conn, conn.makefile("rw") as stream:
        for line in stream:
            _forget(made, held)
            if line.strip() != "make":
                break
            made += [
                f"sem.mp-{secrets.token_hex(4)}",
                f"torch_{os.getpid()}_{secrets.randbelow(10**9)}_0",
                f"psm_{secrets.token_hex(4)}",
            ]
            fds = [os.open(f"{SHM}/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600) for name in made]
            for fd in fds:
                os.ftruncate(fd, mmap.PAGESIZE)
            held += [mmap.mmap(fds[0], mmap.PAGESIZE), fds[1]]  # one mapped, one held open
            os.close(fds[0])
            os.close(fds[2])  # nobody holds this one
            stream.write(f"ok {os.getpid()} {' '.join(made)}\n")
            stream.flush()
        _forget(made, held)
        with contextlib.suppress(OSError):  # (the test may be gone)
            stream.write("ok\n")
            stream.flush()


def _forget(made: list[str], held: list[mmap.mmap | int]) -> None:
    for h in held:
        if isinstance(h, int):
            os.close(h)
        else:
            h.close()
    for name in made:
        os.unlink(f"{SHM}/{name}")
    made.clear()
    held.clear()


if __name__ == "__main__":
    main()
