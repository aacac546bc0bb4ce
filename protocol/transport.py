"""ZeroMQ endpoints. Roles never touch sockets: they hold a ``BufferClient`` or a ``BufferServer``.

The buffer is the hub: it binds one ROUTER socket; rollout, scorers and the learner each connect
a DEALER and make requests. A request may be answered much later (the buffer holds a credit or
batch request until it can be served), so every request carries an id and a client drops any
reply that is not for the request in hand (a late answer to a retried hello, say).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import zmq

from protocol.codec import DEFAULT_MAX_FRAME_BYTES, Message, ProtocolError, cut, decode, encode
from protocol.security import message_key, secure_client, secure_server

log = logging.getLogger(__name__)


class BufferUnreachable(RuntimeError):
    """The buffer did not answer a hello after every retry."""


class BufferLost(BufferUnreachable):
    """The buffer stopped answering (heartbeats or a request past its deadline), came back as
    another run, or restarted under a role that cannot carry on against a new buffer."""


class RemoteError(RuntimeError):
    """The buffer refused a request and said why."""


# what the buffer says to a hello for a worker whose process is still connected
ALIVE_ELSEWHERE = "is connected from another process"

# Requests the buffer holds until it can serve them: waited for as long as it takes, while heartbeats
# say the buffer is there. Every other request is answered at once, within ``request_deadline_s``.
HELD = ("credit_request", "score_request", "batch_request")


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


LINGER_MS = 1000  # a closed socket's messages still go out this long (a role's last words at its exit)


@dataclass
class Liveness:
    """How a client watches the buffer while it waits: a ping every ``heartbeat_s``; no answer to
    anything for ``peer_deadline_s`` and the buffer is lost; a request the buffer answers at once
    gets ``request_deadline_s``. ``reconnect``: after a buffer restart, say hello again and ask
    again (a rollout or scorer holds nothing a new buffer needs); otherwise stop with the reason."""
    heartbeat_s: float = 5.0
    peer_deadline_s: float = 60.0
    request_deadline_s: float = 120.0
    reconnect: bool = True


_CLIENTS = itertools.count()


class BufferClient:
    """A role's connection to the buffer (DEALER). Several requests may be in flight (a streaming
    rollout holds a credit request while it sends samples); a reply to one the caller is not
    waiting on is kept until it asks. While it waits, heartbeats tell a buffer that died or restarted."""

    def __init__(self, address: str, role: str, worker_id: str,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve=None, liveness: Liveness | None = None) -> None:
        self.address, self.role, self.worker_id = address, role, worker_id
        self.max_frame_bytes = max_frame_bytes
        self.liveness = liveness or Liveness()
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, LINGER_MS)
        secure_client(self.socket, curve)
        # unique to this client: a ROUTER ignores a peer whose identity is still connected, and a closed
        # client's lingers a moment (a role that connects again from the same process would be unheard)
        self.socket.setsockopt_string(zmq.IDENTITY, f"{role}:{worker_id}:{os.getpid()}:{next(_CLIENTS)}")
        self.socket.connect(address)
        self._last_request_id = 0
        # requests sent and not yet answered to the caller: id -> (type, fields, tensors, when sent)
        self._pending: dict[int, tuple[str, dict | None, dict | None, float]] = {}
        self._replies: dict[int, Message] = {}  # replies to pending requests, kept until asked for
        # the ping in flight, when the last went out, and since when pings go unanswered (None: none do)
        self._ping_id, self._last_ping, self._unanswered_since = 0, 0.0, None
        self.run_id = self.incarnation = None
        # for the roles' metrics: each stays 0 on a healthy run
        self.counters = {"heartbeats_missed": 0, "buffer_restarts": 0}

    def connect(self, retries: int, interval_s: float) -> Message:
        """Say hello until the buffer answers; raise ``BufferUnreachable`` after ``retries`` tries."""
        for attempt in range(1, retries + 1):
            try:
                welcome = self.request("hello", {"role": self.role, "worker_id": self.worker_id}, timeout_s=interval_s)
            except TimeoutError:
                log.warning("%s: buffer not reachable at %s (try %d of %d), retrying",
                            self.role, self.address, attempt, retries)
                continue
            except RemoteError as refused:  # a restart whose old connection the buffer still sees: a moment more
                if ALIVE_ELSEWHERE not in str(refused) or attempt == retries:
                    raise
                log.warning("%s: %s (try %d of %d), retrying", self.role, refused, attempt, retries)
                time.sleep(interval_s)
                continue
            if self.run_id is not None and welcome.fields["run_id"] != self.run_id:
                raise BufferLost(f"{self.role}: the buffer at {self.address} now serves run "
                                 f"{welcome.fields['run_id']!r}, not {self.run_id!r}")
            self.run_id, self.incarnation = welcome.fields["run_id"], welcome.fields["incarnation"]
            return welcome
        raise BufferUnreachable(
            f"{self.role}: the buffer at {self.address} did not answer after {retries} tries; "
            f"is `tether launch buffer` running with the same transport.buffer_address?"
        )

    def request(self, msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None,
                timeout_s: float | None = None, waiting_for: str | None = None,
                log_every_s: float = 30.0) -> Message:
        """Send one request and wait for its reply. A held request (``HELD``) waits as long as it
        takes, logging every ``log_every_s`` what it waits for; any other gets ``timeout_s`` or the
        request deadline. Either way heartbeats watch the buffer (``reply_to``)."""
        return self.wait(self.send(msg_type, fields, tensors), timeout_s, waiting_for, log_every_s)

    def wait(self, request_id: int, timeout_s: float | None = None, waiting_for: str | None = None,
             log_every_s: float = 30.0) -> Message:
        """The reply to request ``request_id`` (sent by ``send``), waited for as ``request`` says."""
        msg_type = self._pending[request_id][0] if request_id in self._pending else ""
        lost_after_s = None  # a request answered at once that is not answered: the buffer is lost
        if timeout_s is None and msg_type not in HELD:
            timeout_s = lost_after_s = self.liveness.request_deadline_s
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
                self._pending.pop(request_id, None)  # abandoned: a late answer is dropped, never resent
            if lost_after_s is not None and now - started >= lost_after_s:
                raise BufferLost(f"{self.role}: the buffer at {self.address} did not answer {msg_type} within "
                                 f"{lost_after_s:.0f}s (transport.request_deadline_s); it is gone, or the run is over")
            if timeout_s is not None and now - started >= timeout_s:
                raise TimeoutError(f"{self.role}: no reply to {msg_type} within {timeout_s:.1f}s")
            if now - last_log >= log_every_s:
                log.info("%s: waiting %.0fs for %s from the buffer", self.role, now - started, waiting_for or msg_type)
                last_log = now

    def send(self, msg_type: str, fields: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None) -> int:
        """Send a request; returns its id, for ``reply_to`` or ``poll``."""
        self._last_request_id += 1
        self._last_ping = time.monotonic()  # the first heartbeat is due one interval after the request
        self._pending[self._last_request_id] = (msg_type, fields, tensors, self._last_ping)
        self._send(self._last_request_id, msg_type, fields, tensors)
        return self._last_request_id

    def poll(self, request_id: int) -> Message | None:
        """The reply to ``request_id`` if it is here, else None, without waiting (heartbeats and
        deadlines are checked as in ``reply_to``)."""
        return self.reply_to(request_id, self._pending[request_id][0] if request_id in self._pending else "", 0.0)

    def _answered(self, request_id: int, reply: Message, msg_type: str) -> Message:
        del self._pending[request_id]
        if reply.type == "error":
            raise RemoteError(f"buffer refused {msg_type}: {reply.fields['reason']}")
        return reply

    def _check_deadlines(self, now: float) -> None:
        """A request the buffer answers at once, sent and not answered within ``request_deadline_s``
        (one sent without waiting for it, like a streaming rollout's samples): the buffer is lost."""
        for msg_type, _, _, sent in self._pending.values():
            if msg_type not in HELD and msg_type != "hello" and now - sent > self.liveness.request_deadline_s:
                raise BufferLost(f"{self.role}: the buffer at {self.address} did not answer {msg_type} within "
                                 f"{self.liveness.request_deadline_s:.0f}s (transport.request_deadline_s); it is "
                                 "gone, or the run is over")

    def _send(self, request_id: int, msg_type: str, fields, tensors) -> None:
        self.socket.send_multipart(encode(msg_type, fields, tensors, msg_id=request_id), copy=False)

    def reply_to(self, request_id: int, msg_type: str, wait_s: float) -> Message | None:
        """The reply to request ``request_id`` if it comes within ``wait_s``, else None (the request
        stays in flight: ask again later). Raises ``RemoteError`` if the buffer refused it, and
        ``BufferLost`` if the buffer stopped answering heartbeats or came back as another run.
        While waiting, a ping goes out every ``heartbeat_s`` (once a hello was answered)."""
        if request_id in self._replies:
            return self._answered(request_id, self._replies.pop(request_id), msg_type)
        deadline = time.monotonic() + wait_s
        heartbeats = self.incarnation is not None and msg_type != "hello"
        while True:
            now = time.monotonic()
            self._check_deadlines(now)
            wake = deadline
            if heartbeats:
                self._heartbeat(now, msg_type)
                wake = min(deadline, self._last_ping + self.liveness.heartbeat_s)
            if not self.socket.poll(max(0, int((wake - now) * 1000)), zmq.POLLIN):
                if time.monotonic() >= deadline:
                    return None
                continue
            reply_frames = self.socket.recv_multipart(copy=False)
            try:
                reply = decode(reply_frames, self.max_frame_bytes)
            except ProtocolError as error:
                log.error("%s: refused a reply from the buffer: %s", self.role, error)
                continue
            self._unanswered_since = None  # anything from the buffer says it is there
            if reply.type == "pong" and reply.id == self._ping_id:
                self._pong(reply, request_id)
                continue
            if reply.id == request_id:
                return self._answered(request_id, reply, msg_type)
            if reply.id in self._pending:  # another request in flight: its caller asks for it later
                self._replies[reply.id] = reply
            # else: an answer to an earlier, abandoned request (a hello retried, say)

    def _heartbeat(self, now: float, msg_type: str) -> None:
        silent = now - self._unanswered_since if self._unanswered_since is not None else 0.0
        if silent > self.liveness.peer_deadline_s:
            raise BufferLost(f"{self.role}: the buffer at {self.address} has answered no heartbeat for {silent:.0f}s "
                             f"(transport.peer_deadline_s {self.liveness.peer_deadline_s:.0f}) while this role "
                             f"waited for {msg_type}")
        if now - self._last_ping >= self.liveness.heartbeat_s:
            if self._unanswered_since is not None:  # the last ping went unanswered
                self.counters["heartbeats_missed"] += 1
            else:
                self._unanswered_since = now
            self._ping_id = self._last_request_id = self._last_request_id + 1
            self._send(self._ping_id, "ping", None, None)
            self._last_ping = now

    def _pong(self, pong: Message, request_id: int) -> None:
        """A pong from another run, or from a buffer that restarted (and so lost the request in hand)."""
        if pong.fields["run_id"] != self.run_id:
            raise BufferLost(f"{self.role}: the buffer at {self.address} now serves run {pong.fields['run_id']!r}, "
                             f"not {self.run_id!r}")
        if pong.fields["incarnation"] == self.incarnation:
            return
        self.counters["buffer_restarts"] += 1
        if not self.liveness.reconnect:
            raise BufferLost(f"{self.role}: the buffer at {self.address} restarted and lost what it held for this "
                             "run; start the run again from its last checkpoint (`tether run --resume`)")
        log.warning("%s: the buffer restarted (incarnation %s -> %s); saying hello again and asking again",
                    self.role, self.incarnation, pong.fields["incarnation"])
        pending, self._ping_id = dict(self._pending), 0
        self._pending.clear()
        self.incarnation = None
        self.connect(retries=10, interval_s=self.liveness.heartbeat_s)
        self._replies.clear()  # the old buffer's answers mean nothing to the new one's state
        for pending_id, (msg_type, fields, tensors, _) in pending.items():  # again, under the ids callers wait on
            self._pending[pending_id] = (msg_type, fields, tensors, time.monotonic())
            self._send(pending_id, msg_type, fields, tensors)

    def goodbye(self, error: BaseException) -> None:
        """The last words of a rollout or scorer that stops on ``error``: the buffer takes back what it
        gave this process. Sent, never waited on (the buffer may be what failed, and ``error`` must
        stay the one raised); the socket closes lingering, so they still go out."""
        self.socket.setsockopt(zmq.SNDTIMEO, 0)  # a queue full towards a dead buffer: no wait, no new error
        try:
            self.send("goodbye", {"reason": cut(f"{type(error).__name__}: {error}")})
        except zmq.ZMQError:
            pass
        self.close()

    def close(self) -> None:
        self.socket.close()


def connect_to_buffer(config, role: str, worker_id: str) -> BufferClient:
    """A role's client, connected, watching the buffer as ``config.transport`` says. Only the learner
    does not carry on against a restarted buffer: its batches and versions live in the buffer's state."""
    transport = config.transport
    client = BufferClient(config.buffer_address, role, worker_id, transport.max_frame_bytes, transport.curve,
                          Liveness(transport.heartbeat_s, transport.peer_deadline_s, transport.request_deadline_s,
                                   reconnect=role != "learner"))
    client.connect(transport.connect_retries, transport.connect_interval_s)
    return client


class BufferServer:
    """The buffer's ROUTER socket: receive validated requests, reply when ready."""

    def __init__(self, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve=None,
                 heartbeat_s: float = 5.0, peer_deadline_s: float = 60.0) -> None:
        prepare_endpoint(address)
        self.max_frame_bytes = max_frame_bytes
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        secure_server(self.socket, curve)
        self.socket.setsockopt(zmq.LINGER, LINGER_MS)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # ZMTP heartbeats, answered by the peer's ZeroMQ itself (an idle role too): a peer on a node that
        # went away (its TCP connection half-open) loses its route within peer_deadline_s, so that
        # ``connected`` tells its restart from a second live process
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(peer_deadline_s * 1000))
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
            message = decode(body, self.max_frame_bytes)
            message.key = message_key(body[0])
            return identity, message
        except ProtocolError as error:
            self.refused += 1
            log.warning("buffer: refused a message from %r: %s", identity, error)
            self.reply(identity, -1, "error", {"reason": cut(str(error))})
            return None

    def connected(self, identity: bytes) -> bool:
        """Whether the peer of ``identity`` is still connected: a probe sent with ROUTER_MANDATORY,
        which says whether ZeroMQ has a route to it (a process that died has none a moment after);
        the probe is a pong of no request, which a client drops."""
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.socket.send_multipart([identity, *encode("pong", {"run_id": "", "incarnation": ""}, msg_id=-1)],
                                       flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # connected, its queue full
            return True
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                return False
            raise
        finally:
            self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)

    def reply(self, identity: bytes, request_id: int, msg_type: str, fields: dict[str, Any] | None = None,
              tensors: dict[str, Any] | None = None) -> None:
        frames = encode(msg_type, fields, tensors, msg_id=request_id)
        self.socket.send_multipart([identity] + frames, copy=False)

    def close(self) -> None:
        self.socket.close()
