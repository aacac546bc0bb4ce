"""Checking a version while it is being written: the learner announces each bucket of a version
the moment it is in shared memory; the rollout's ``WeightPrefetcher`` thread checks it right
away, on the other core, instead of checking the whole version after the learner is done.

The announcement rides a PUB socket: a rollout that misses some (it joined late, or fell behind)
simply finds its prefetch incomplete and checks the version itself when it loads it. While it
checks, the prefetcher holds a shared lock on the slot until the version is loaded or given up,
so the learner cannot reuse that slot and a checked version stays exactly as checked.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import zmq

from protocol.codec import ProtocolError, decode, encode
from protocol.transport import prepare_endpoint
from weight_sync.buckets import BucketEntry, WeightManifest, _reader_map, _slot_lock, checksum, outside

log = logging.getLogger(__name__)


class WeightStreamPublisher:
    """The learner's side: one notice per bucket, as it is written (``ShmWeightWriter.publish``'s
    ``on_bucket``)."""

    def __init__(self, address: str) -> None:
        prepare_endpoint(address)
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.bind(address)

    def announcer(self, version: int):
        def announce(total: int, bucket: BucketEntry) -> None:
            self.socket.send_multipart(encode("weights_bucket_ready", {
                "policy_version": version, "buckets_total": total, "bucket": bucket.to_dict()}))
        return announce

    def close(self) -> None:
        self.socket.close()


class WeightPrefetcher:
    """The rollout's side: a thread that checks announced buckets as they come, those under
    ``directory`` (the run's weight directory) only."""

    def __init__(self, address: str, directory: str) -> None:
        self.directory = directory
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 100_000)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(address)
        self._mutex = threading.Lock()
        self._version = -1
        self._total = 0
        self._checked: dict[int, str] = {}  # bucket index -> checksum that matched
        self._failed = False
        self._locks: dict[str, object] = {}  # slot directory -> shared lock held for the version in check
        self._pinned: dict[str, object] = {}  # locks of a checked version the rollout is loading
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(100):
                continue
            try:
                notice = decode(self.socket.recv_multipart())
                if notice.type != "weights_bucket_ready":
                    raise ProtocolError(f"unexpected {notice.type!r} on the weight stream")
                bucket = BucketEntry.from_dict(notice.fields["bucket"])
                refused = outside(WeightManifest(notice.fields["policy_version"], [bucket]), self.directory)
                if refused:
                    raise ProtocolError(refused)
            except ProtocolError as error:
                log.warning("weight stream: refused a notice: %s", error)
                continue
            self._check(notice.fields["policy_version"], notice.fields["buckets_total"], bucket)

    def _check(self, version: int, total: int, bucket: BucketEntry) -> None:
        with self._mutex:
            if version < self._version:
                return
            if version > self._version:
                self._release_locked()
                self._version, self._total, self._checked, self._failed = version, total, {}, False
            directory = bucket.path.rsplit("/", 1)[0]
            if directory not in self._locks:
                lock = _slot_lock(directory, exclusive=False)
                try:
                    lock.__enter__()
                except OSError:
                    self._failed = True
                    return
                self._locks[directory] = lock
        try:
            payload = np.frombuffer(_reader_map(bucket.path, bucket.nbytes), dtype=np.uint8) if bucket.nbytes else b""
            ok = checksum(payload) == bucket.checksum
        except OSError:
            ok = False
        with self._mutex:
            if version == self._version:
                if ok:
                    self._checked[bucket.index] = bucket.checksum
                else:
                    self._failed = True

    def checked(self, manifest: WeightManifest) -> bool:
        """True when every bucket of ``manifest`` was checked and its slots are held since; the
        slots then stay held (pinned), whatever the stream brings next, until ``release``."""
        with self._mutex:
            complete = (manifest.policy_version == self._version and not self._failed
                        and len(self._checked) == self._total == len(manifest.buckets)
                        and all(self._checked.get(b.index) == b.checksum for b in manifest.buckets)
                        and all(b.path.rsplit("/", 1)[0] in self._locks for b in manifest.buckets))
            if complete:
                self._pinned.update(self._locks)
                self._locks = {}
            return complete

    def release(self) -> None:
        """Give back the slots pinned by ``checked`` (once that version is loaded, or given up)."""
        with self._mutex:
            for lock in self._pinned.values():
                lock.__exit__(None, None, None)
            self._pinned = {}

    def _release_locked(self) -> None:
        for lock in self._locks.values():
            lock.__exit__(None, None, None)
        self._locks = {}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.release()
        with self._mutex:
            self._release_locked()
        self.socket.close()
