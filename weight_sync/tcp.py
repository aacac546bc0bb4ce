"""The across-hosts path of weight sync: the learner serves its published buckets as raw ZeroMQ
frames over TCP, one bucket per request (the client sets the pace, so a slow link never piles up
gigabytes in a queue); the rollout stores them in its own slots and checks every checksum.

On one host this is not needed: the rollout reads the learner's shared memory directly.
"""

from __future__ import annotations

import logging
import threading

import zmq

from protocol.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, cut, decode, encode
from protocol.security import secure_client, secure_server
from weight_sync.buckets import ShmWeightWriter, WeightManifest, WeightStreamError, _slot_lock

log = logging.getLogger(__name__)


class WeightServer:
    """A thread of the learner answering ``weights_fetch`` from the slots of ``writer``."""

    def __init__(self, writer: ShmWeightWriter, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 curve=None) -> None:
        self.writer, self.max_frame_bytes = writer, max_frame_bytes
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        secure_server(self.socket, curve)
        self.socket.bind(address)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port if ":0" was asked
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(100):
                continue
            identity, *frames = self.socket.recv_multipart()
            request_id = -1
            try:
                request = decode(frames, self.max_frame_bytes)
                request_id = request.id
                if request.type != "weights_fetch":
                    raise ProtocolError(f"the weight server does not take {request.type!r}")
                reply = self._bucket(request.fields["policy_version"], request.fields["bucket"])
                self.socket.send_multipart([identity] + encode(*reply, msg_id=request.id), copy=False)
            except (ProtocolError, WeightStreamError) as error:
                self.refused += 1
                log.warning("weight server: refused a request: %s", error)
                self.socket.send_multipart([identity] + encode("error", {"reason": cut(str(error))}, msg_id=request_id))
            except Exception as error:  # a slot recycled mid-read, a bug: this request fails, the server serves on
                self.refused += 1
                log.exception("weight server: could not answer a request")
                self.socket.send_multipart([identity] + encode("error", {"reason": cut(
                    f"the weight server could not answer ({type(error).__name__}: {error})")}, msg_id=request_id))

    def _bucket(self, version: int, index: int) -> tuple:
        slot = self.writer.slot_of(version)
        if slot is None:
            raise WeightStreamError(f"version {version} is no longer held; fetch the newest")
        with _slot_lock(slot.directory, exclusive=False):  # the writer cannot claim the slot meanwhile
            manifest = slot.manifest
            if manifest is None or manifest.policy_version != version:
                raise WeightStreamError(f"version {version} is no longer held; fetch the newest")
            if not 0 <= index < len(manifest.buckets):
                raise WeightStreamError(f"version {version} has no bucket {index}")
            bucket = manifest.buckets[index]
            payload = slot.payload(index).copy()  # out of the slot before the lock goes
        return "weights_bucket", {"policy_version": version, "bucket": index, "checksum": bucket.checksum}, {"payload": payload}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()


def fetch_over_tcp(manifest: WeightManifest, address: str, staging: ShmWeightWriter,
                   timeout_s: float = 60.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, curve=None) -> WeightManifest:
    """Fetch every bucket of ``manifest`` from the learner's weight server into ``staging`` and
    return the local manifest. Raises ``WeightStreamError`` if any bucket is refused, late, or
    fails its checksum; nothing partial is ever returned."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    secure_client(socket, curve)
    socket.connect(address)
    try:
        payloads = []
        for bucket in manifest.buckets:
            socket.send_multipart(encode("weights_fetch", {"policy_version": manifest.policy_version, "bucket": bucket.index},
                                         msg_id=bucket.index))
            if not socket.poll(int(timeout_s * 1000)):
                raise WeightStreamError(f"version {manifest.policy_version}: bucket {bucket.index} did not come within "
                                        f"{timeout_s:.0f}s from {address}")
            try:
                reply = decode(socket.recv_multipart(copy=False), max_frame_bytes)
            except ProtocolError as error:
                raise WeightStreamError(f"version {manifest.policy_version}: bucket {bucket.index}: {error}") from None
            if reply.type == "error":
                raise WeightStreamError(f"version {manifest.policy_version}: {reply.fields['reason']}")
            payload = reply.tensors["payload"]
            if reply.fields["checksum"] != bucket.checksum or payload.nbytes != bucket.nbytes:
                raise WeightStreamError(f"version {manifest.policy_version}: bucket {bucket.index} does not match its "
                                        "manifest (size or checksum)")
            payloads.append(payload)
        return staging.store(manifest, payloads)
    finally:
        socket.close()
