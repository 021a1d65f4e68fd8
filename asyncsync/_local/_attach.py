"""Workers that attach by address: any process on the host joins as worker *k*.

The trainer listens on a Unix socket: by default a Linux abstract socket (``@name``:
nothing on disk, gone with the process however it ends), elsewhere a socket file in a
private directory; or a path the user gives.
A joining process proves it knows the shared token with the control plane's challenge
(:func:`~.._wire._auth.new_nonce`, :func:`~.._wire._auth.mac`,
:func:`~.._wire._auth.welcome_mac`): the trainer sends a ``Challenge``, the worker
answers ``Auth`` (its worker index, its pid, a nonce of its own and its MAC), the trainer
answers ``Welcome`` (its own MAC) or a ``Bye`` saying why it refused. The token never
travels. From then on the socket is exactly what a spawned worker's pipe is: the local
binary protocol, with the shared-memory segments' descriptors passed by SCM_RIGHTS.

Handshake frames use the same length framing as the pipes (``Connection.send_bytes``),
and each side reads exactly one frame at a time, so nothing is read ahead when the
socket is handed to the sender's link or to the receiver.

Example::

    address = await scheme.listen()            # trainer
    env = address.env()                        # {"ASYNCSYNC_ADDRESS": "unix:@asyncsync-...?token=..."}

    scheme = MultiProcessWeightSyncScheme.attach(address_string, worker_idx=1)  # elsewhere
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
import sys
import tempfile
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlencode

import anyio

from .._core._deadline import Deadline
from .._errors import AuthenticationError, ProtocolError, SyncTimeoutError
from .._wire._auth import HANDSHAKE_LIMIT, mac, new_nonce, resolve_token, welcome_mac
from .._wire._control import HEADER_BYTES, Auth, Bye, Challenge, Welcome, decode_handshake, encode

if TYPE_CHECKING:
    from ._transport import LocalTransport

__all__ = ["ADDRESS_ENV", "Listener", "WorkerAddress", "dial"]

logger = logging.getLogger("asyncsync")

ADDRESS_ENV = "ASYNCSYNC_ADDRESS"
_SCHEME = "unix:"
_HANDSHAKE_TIMEOUT = 10.0  # how long an accepted connection may take to authenticate
_VERDICT_LIMIT = 4096  # a refusal's reason, read before the trainer proved itself
_RETRY_S = 0.05  # between two connection attempts while the trainer is not listening yet
_LEN = struct.Struct("!i")
#: Linux has abstract socket names ("@name"): the default address, nothing left on disk after a crash.
ABSTRACT_SOCKETS = sys.platform.startswith("linux")
_SUN_PATH = 107  # bytes in a socket's address (sun_path, less a terminating NUL)

# Bye.version of a refusal: why the trainer refused (the reason says it in words).
_REFUSED_TOKEN = -1
_REFUSED_INDEX = -2
_REFUSED_TAKEN = -3


@dataclasses.dataclass(frozen=True)
class WorkerAddress:
    """Where and how a worker attaches to a listening trainer.

    *path* is an absolute Unix socket path, or ``"@name"`` for a Linux abstract socket (it
    vanishes with the trainer's process: nothing to clean up after a crash). *token* is the shared
    secret; the other fields are the trainer's scheme options a worker must agree on.
    ``str()`` gives a one-line form (it holds the token: hand it over like a password)
    that :meth:`from_string` reads back; :meth:`env` gives it as ``ASYNCSYNC_ADDRESS``.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        address = await scheme.listen()            # Linux: an abstract socket, no file
        text = str(address)                        # unix:@asyncsync-...?token=...
        assert WorkerAddress.from_string(text) == address
        # Any process on this host joins with the text alone (here: this one).
        worker = MultiProcessWeightSyncScheme.attach(text, worker_idx=0)
        worker.init_on_receiver(model=make_policy())
        await asyncio.gather(scheme.connect(), worker.connect())
        print(await scheme.send(), worker.version)  # 1 1
        await worker.aclose()
        await scheme.aclose()                      # stops listening
    """

    path: str
    token: str | None = dataclasses.field(default=None, repr=False)
    strategy: str = "tensordict"
    commit: str = "swap"
    commit_mode: str = "auto"
    timeout: float | None = 60.0

    def __str__(self) -> str:
        query: dict[str, str] = {}
        if self.token is not None:
            query["token"] = self.token
        query.update(strategy=self.strategy, commit=self.commit, commit_mode=self.commit_mode)
        query["timeout"] = "none" if self.timeout is None else repr(float(self.timeout))
        return f"{_SCHEME}{quote(self.path, safe='/@._-')}?{urlencode(query)}"

    @classmethod
    def from_string(cls, text: str) -> WorkerAddress:
        """Parse the form ``str(address)`` gives (``unix:PATH?token=...&...``)."""
        if not isinstance(text, str) or not text.startswith(_SCHEME):
            raise ValueError(f"not a worker address (expected 'unix:PATH?token=...'): {text!r}")
        path, _, query = text[len(_SCHEME) :].partition("?")
        if not path:
            raise ValueError(f"the worker address {text!r} has no socket path")
        fields = dict(parse_qsl(query, keep_blank_values=True))
        unknown = set(fields) - {"token", "strategy", "commit", "commit_mode", "timeout"}
        if unknown:
            raise ValueError(f"the worker address {text!r} has unknown fields {sorted(unknown)}")
        timeout_text = fields.get("timeout", "60")
        try:
            timeout = None if timeout_text == "none" else float(timeout_text)
        except ValueError:
            raise ValueError(f"the worker address {text!r} has a bad timeout {timeout_text!r}") from None
        return cls(
            unquote(path),
            fields.get("token"),
            fields.get("strategy", "tensordict"),
            fields.get("commit", "swap"),
            fields.get("commit_mode", "auto"),
            timeout,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerAddress:
        """The address in ``ASYNCSYNC_ADDRESS`` (a launcher's way to hand it to a process)."""
        text = (os.environ if environ is None else environ).get(ADDRESS_ENV)
        if not text:
            raise ValueError(f"no worker address given, and {ADDRESS_ENV} is not set")
        return cls.from_string(text)

    def env(self) -> dict[str, str]:
        """``{"ASYNCSYNC_ADDRESS": str(self)}``, to add to a worker process's environment."""
        return {ADDRESS_ENV: str(self)}

    def sockaddr(self) -> str | bytes:
        """What ``socket.connect`` takes: the path, or the abstract name."""
        return b"\0" + self.path[1:].encode() if self.path.startswith("@") else self.path


def attach_mac(token: bytes, challenge: bytes, worker_idx: int) -> bytes:
    """The worker's proof: a relay's ``Auth`` MAC under a label of its own."""
    return mac(token, b"worker", challenge, struct.pack("!I", worker_idx))


# ---------------------------------------------------------------------- framing


def _frame(msg: Any) -> bytes:
    payload = encode(msg)
    return _LEN.pack(len(payload)) + payload


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise EOFError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


async def _recv_message(loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int) -> Any:
    """One framed protocol message, its size checked before its payload is read."""
    (size,) = _LEN.unpack(await _recv_exactly(loop, sock, _LEN.size))
    if size < HEADER_BYTES or size > HEADER_BYTES + limit:
        raise ProtocolError(f"a handshake frame of {size} bytes (at most {HEADER_BYTES + limit})")
    return decode_handshake(await _recv_exactly(loop, sock, size))


def _to_connection(sock: socket.socket) -> Connection:
    """Hand *sock* over as a pipe-like ``Connection`` (blocking, as a pipe's end is)."""
    sock.setblocking(True)
    return Connection(sock.detach())


# ---------------------------------------------------------------------- trainer side


class Listener:
    """The trainer's listening socket: authenticates joining workers and hands each
    accepted socket to the sender's transport as worker *k*'s next link. Made by ``scheme.listen()``.

    ``refused`` counts refused connections (wrong token, unknown or taken worker index);
    each is logged as a warning.
    """

    def __init__(self, transport: LocalTransport, address: WorkerAddress, token: bytes, sock: socket.socket, own_dir: str | None) -> None:
        self.address = address
        self.refused = 0
        self._transport = transport
        self._token = token
        self._sock: socket.socket | None = sock
        self._own_dir = own_dir
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept(), name="asyncsync-attach-accept")

    @classmethod
    async def open(cls, transport: LocalTransport, options: Mapping[str, Any], path: str | None, token: str | bytes | None) -> Listener:
        raw = resolve_token(token)
        if raw is None:
            raw = secrets.token_urlsafe(24).encode()
        try:
            text_token = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the token must be valid UTF-8 to travel in a worker address") from None
        own_dir = None
        if path is None and ABSTRACT_SOCKETS:
            path = "@asyncsync-" + secrets.token_hex(8)  # nothing on disk: it ends with this process
        elif path is None:
            own_dir = tempfile.mkdtemp(prefix="asyncsync-")  # mode 0700: only this user reaches it
            path = os.path.join(own_dir, "trainer.sock")
        else:
            path = _checked_path(path)
        address = WorkerAddress(path, text_token, **options)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if not path.startswith("@"):
                _remove_stale(path)
            sock.bind(address.sockaddr())
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            if own_dir is not None:
                shutil.rmtree(own_dir, ignore_errors=True)
            raise
        logger.info("asyncsync: listening for workers at %s", path)
        return cls(transport, address, raw, sock, own_dir)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                logger.warning("asyncsync: accepting workers at %s failed: %s", self.address.path, exc)
                await asyncio.sleep(_RETRY_S)  # EMFILE and the like: try again, not in a tight loop
                continue
            conn.setblocking(False)
            task = loop.create_task(self._serve(conn), name="asyncsync-attach-handshake")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            with anyio.fail_after(_HANDSHAKE_TIMEOUT):
                nonce = new_nonce()
                await loop.sock_sendall(sock, _frame(Challenge(nonce)))
                msg = await _recv_message(loop, sock, HANDSHAKE_LIMIT)
            if not isinstance(msg, Auth):
                raise ProtocolError(f"expected Auth, got {type(msg).__name__}")
            idx = msg.host
            if not hmac.compare_digest(msg.mac, attach_mac(self._token, nonce, idx)):
                self._refuse(sock, idx, _REFUSED_TOKEN, "the token was refused", msg.pid)
                return
            reason = self._transport.attach_refusal(idx)
            if reason is not None:
                code = _REFUSED_INDEX if idx not in self._transport.worker_ids else _REFUSED_TAKEN
                self._refuse(sock, idx, code, reason, msg.pid)
                return
            welcome = _frame(Welcome(welcome_mac(self._token, msg.nonce)))
            if sock.send(welcome) != len(welcome):  # an empty socket buffer takes it whole
                raise OSError("could not write the welcome")
            # No await since attach_refusal(): nobody else took this index meanwhile.
            self._transport.adopt_link(idx, _to_connection(sock))
            logger.info("asyncsync: worker %d attached (pid %d)", idx, msg.pid)
        except (OSError, EOFError, ProtocolError, TimeoutError) as exc:
            logger.warning("asyncsync: a connection to %s ended during its handshake: %r", self.address.path, exc)
        finally:
            if sock.fileno() >= 0:
                sock.close()

    def _refuse(self, sock: socket.socket, idx: int, code: int, reason: str, pid: int) -> None:
        self.refused += 1
        logger.warning("asyncsync: refused a worker claiming index %d (pid %d) at %s: %s", idx, pid, self.address.path, reason)
        with contextlib.suppress(OSError):
            sock.send(_frame(Bye(idx, code, reason[:1000])))

    async def aclose(self) -> None:
        """Stop accepting, end the handshakes under way, remove the socket file. Idempotent."""
        if self._sock is None:
            return
        tasks = [self._accepting, *self._tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.close()
        self._sock = None
        if not self.address.path.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address.path)
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)


def _checked_path(path: str | os.PathLike[str]) -> str:
    """*path* made absolute (an ``@name`` as it is), refused by name when it cannot be bound."""
    path = os.fspath(path)
    if not isinstance(path, str) or not path or path == "@":
        raise ValueError(f"listen(path=...): a socket path or '@name' is needed, got {path!r}")
    if path.startswith("@"):
        if not ABSTRACT_SOCKETS:
            raise ValueError(f"listen(path={path!r}): abstract socket names ('@name') exist on Linux only; give a file path")
    else:
        path = os.path.abspath(path)  # the address must mean the same file to a worker in another directory
    size = len(os.fsencode(path))
    if size > _SUN_PATH:
        raise ValueError(
            f"listen(path=...): the socket path {path!r} is {size} bytes, a Unix socket's address holds at most "
            f"{_SUN_PATH}: choose a shorter path" + (" or an abstract '@name'" if ABSTRACT_SOCKETS else "")
        )
    return path


def _remove_stale(path: str) -> None:
    """Remove a socket file nobody listens on (left by a trainer that crashed); refuse a live one."""
    if not os.path.exists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise FileExistsError(f"{path} exists and is not a socket: choose another path for the trainer to listen on")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)  # a live listener answers at once; never hang on a full backlog
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # stale
        return
    except OSError:
        return
    finally:
        probe.close()
    raise FileExistsError(f"another trainer listens at {path}")


# ---------------------------------------------------------------------- worker side


async def dial(address: WorkerAddress, worker_idx: int, timeout: float | None) -> socket.socket:
    """Connect to the trainer at *address* as *worker_idx* and pass its challenge.

    Retries while nothing listens there yet, for at most *timeout* seconds in all
    (:class:`SyncTimeoutError` naming the address). A refused token raises
    :class:`AuthenticationError`; an index the trainer does not have, or one already
    connected, raises :class:`ValueError`. Returns the authenticated socket.
    """
    raw = resolve_token(address.token)
    if raw is None:
        raise ValueError(f"the worker address {address.path} has no token, and ASYNCSYNC_TOKEN is not set")
    loop = asyncio.get_running_loop()
    deadline = Deadline(timeout)
    what = f"worker {worker_idx} attaching to the trainer at {address.path}"
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            with anyio.fail_after(deadline.remaining()):
                await loop.sock_connect(sock, address.sockaddr())
                break
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            left = deadline.remaining()
            if left is not None and left <= 0:
                raise SyncTimeoutError(f"{what} (nothing listens there)", {}, timeout) from None
            await asyncio.sleep(_RETRY_S if left is None else min(_RETRY_S, left))
        except TimeoutError:
            sock.close()
            raise SyncTimeoutError(what, {}, timeout) from None
        except BaseException:
            sock.close()
            raise
    try:
        try:
            with anyio.fail_after(deadline.remaining()):
                challenge = await _recv_message(loop, sock, HANDSHAKE_LIMIT)
                if not isinstance(challenge, Challenge):
                    raise ProtocolError(f"the trainer at {address.path}: expected Challenge, got {type(challenge).__name__}")
                nonce = new_nonce()
                auth = Auth(worker_idx, 1, os.getpid(), nonce, attach_mac(raw, challenge.nonce, worker_idx))
                await loop.sock_sendall(sock, _frame(auth))
                verdict = await _recv_message(loop, sock, _VERDICT_LIMIT)
        except TimeoutError:
            raise SyncTimeoutError(f"{what}: the handshake", {}, timeout) from None
        except (EOFError, ConnectionResetError) as exc:
            raise AuthenticationError(f"{what}: the trainer closed the connection during the handshake ({exc})") from None
        if isinstance(verdict, Bye):
            message = f"worker {worker_idx}: the trainer at {address.path} refused it: {verdict.reason}"
            if verdict.version == _REFUSED_TOKEN:
                raise AuthenticationError(message)
            raise ValueError(message)
        if not isinstance(verdict, Welcome) or not hmac.compare_digest(verdict.mac, welcome_mac(raw, nonce)):
            raise AuthenticationError(f"{what}: the peer failed the token challenge (it is not the trainer)")
    except BaseException:
        sock.close()
        raise
    return sock


def adopt_into(sock: socket.socket, fd: int) -> None:
    """Put the authenticated *sock* behind descriptor *fd* (the receiver's channel), then close *sock*."""
    sock.setblocking(True)
    try:
        os.dup2(sock.fileno(), fd)
    finally:
        sock.close()


def placeholder_connection() -> Connection:
    """An unconnected Unix socket as a ``Connection``: the receiver's channel until
    :func:`dial` succeeds and :func:`adopt_into` puts the real one behind it."""
    return Connection(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).detach())
