"""ZeroMQ endpoints. Roles never touch sockets: they hold a ``BufferClient`` or a ``BufferServer``.

The buffer is the hub: it binds one ROUTER socket; rollout, scorers and the learner each connect
a DEALER and make requests. A request may be answered much later (the buffer holds a credit or
batch request until it can be served), so every request carries an id and a client drops any
reply that is not for the request in hand (a late answer to a retried hello, say).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from protocol.codec import DEFAULT_MAX_FRAME_BYTES, Message, ProtocolError, decode, encode
from protocol.security import secure_client, secure_server

log = logging.getLogger(__name__)


class BufferUnreachable(RuntimeError):
    """The buffer did not answer a hello after every retry."""


class RemoteError(RuntimeError):
    """The buffer refused a request and said why."""


def free_port() -> int:
    """A TCP port nobody listens on now, on loopback (for a rendezvous or a test endpoint)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prepare_endpoint(address: str) -> None:
    """Make the directory of an ipc endpoint, readable by this user only. An existing directory
    that others can enter is refused, not tightened: it may be a shared one like /tmp."""
    if address.startswith("ipc://"):
        directory = os.path.dirname(address[len("ipc://"):])
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            if os.stat(directory).st_mode & 0o077:
                raise PermissionError(f"{directory}, the directory of the ipc endpoint {address}, is open to other "
                                      "users: name a private one (mode 700), e.g. the default under the run dir")


class BufferClient:
    """A role's connection to the buffer (DEALER)."""

    def __init__(self, address: str, role: str, worker_id: str,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve=None) -> None:
        self.address, self.role, self.worker_id = address, role, worker_id
        self.max_frame_bytes = max_frame_bytes
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        secure_client(self.socket, curve)
        self.socket.setsockopt_string(zmq.IDENTITY, f"{role}:{worker_id}:{os.getpid()}")
        self.socket.connect(address)
        self._last_request_id = 0

    def connect(self, retries: int, interval_s: float) -> Message:
        """Say hello until the buffer answers; raise ``BufferUnreachable`` after ``retries`` tries."""
        for attempt in range(1, retries + 1):
            try:
                return self.request("hello", {"role": self.role, "worker_id": self.worker_id}, timeout_s=interval_s)
            except TimeoutError:
                log.warning("%s: buffer not reachable at %s (try %d of %d), retrying",
                            self.role, self.address, attempt, retries)
        raise BufferUnreachable(
            f"{self.role}: the buffer at {self.address} did not answer after {retries} tries; "
            f"is `tether launch buffer` running with the same transport.buffer_address?"
        )

    def request(self, msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None,
                timeout_s: float | None = None, waiting_for: str | None = None,
                log_every_s: float = 30.0) -> Message:
        """Send one request and wait for its reply. ``timeout_s=None`` waits as long as it takes,
        logging every ``log_every_s`` what it waits for, so a stall is never silent."""
        request_id = self.send(msg_type, fields, tensors)
        started = last_log = time.monotonic()
        while True:
            if timeout_s is not None:
                wait_s = max(0.0, started + timeout_s - time.monotonic())
            else:
                wait_s = log_every_s
            reply = self.reply_to(request_id, msg_type, wait_s)
            if reply is not None:
                return reply
            now = time.monotonic()
            if timeout_s is not None and now - started >= timeout_s:
                raise TimeoutError(f"{self.role}: no reply to {msg_type} within {timeout_s:.1f}s")
            if now - last_log >= log_every_s:
                log.info("%s: waiting %.0fs for %s from the buffer", self.role, now - started, waiting_for or msg_type)
                last_log = now

    def send(self, msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None) -> int:
        """Send a request; returns its id, for ``reply_to``."""
        self._last_request_id += 1
        self.socket.send_multipart(encode(msg_type, fields, tensors, msg_id=self._last_request_id), copy=False)
        return self._last_request_id

    def reply_to(self, request_id: int, msg_type: str, wait_s: float) -> Message | None:
        """The reply to request ``request_id`` if it comes within ``wait_s``, else None (the request
        stays in flight: ask again later). Raises ``RemoteError`` if the buffer refused it."""
        deadline = time.monotonic() + wait_s
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(remaining_ms, zmq.POLLIN):
                return None
            reply_frames = self.socket.recv_multipart(copy=False)
            try:
                reply = decode(reply_frames, self.max_frame_bytes)
            except ProtocolError as error:
                log.error("%s: refused a reply from the buffer: %s", self.role, error)
                continue
            if reply.id != request_id:
                continue  # an answer to an earlier, abandoned request
            if reply.type == "error":
                raise RemoteError(f"buffer refused {msg_type}: {reply.fields['reason']}")
            return reply

    def close(self) -> None:
        self.socket.close()


class BufferServer:
    """The buffer's ROUTER socket: receive validated requests, reply when ready."""

    def __init__(self, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve=None) -> None:
        prepare_endpoint(address)
        self.max_frame_bytes = max_frame_bytes
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        secure_server(self.socket, curve)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A hard memory guard well above the limit: ZeroMQ drops a peer past it without a word, so
        # frames between the two reach decode(), which refuses them with a reason and a count.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 4 * max_frame_bytes)
        self.socket.bind(address)
        self.refused = 0

    def receive(self, timeout_ms: int) -> tuple[bytes, Message] | None:
        """The next valid request, or None after ``timeout_ms``. A bad one is refused, logged,
        counted and answered with an ``error`` reply; the server keeps serving."""
        if not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        frames = self.socket.recv_multipart(copy=False)
        identity, body = frames[0].bytes, frames[1:]
        try:
            return identity, decode(body, self.max_frame_bytes)
        except ProtocolError as error:
            self.refused += 1
            log.warning("buffer: refused a message from %r: %s", identity, error)
            self.reply(identity, -1, "error", {"reason": str(error)})
            return None

    def reply(self, identity: bytes, request_id: int, msg_type: str, fields: dict[str, Any] | None = None,
              tensors: dict[str, Any] | None = None) -> None:
        frames = encode(msg_type, fields, tensors, msg_id=request_id)
        self.socket.send_multipart([identity] + frames, copy=False)

    def close(self) -> None:
        self.socket.close()
