"""Weight sync, learner -> rollout process on one host, against memcpy measured in the same run.

The learner side writes 1 GiB of fp32 tensors as checked buckets into its shared-memory slots
(``ShmWeightWriter``), announcing each bucket as it is written (``WeightStreamPublisher``), then
sends the manifest (what the buffer's credit reply carries in a run). The rollout process checks
the buckets as they are announced (``WeightPrefetcher``, as the rollout role does), and on the
manifest builds the tensors (``read_manifest``), then answers. A second mode has the rollout check
everything only after the manifest (what happens when it missed the announcements). The figure
is bytes / (publish start -> rollout's answer). memcpy (numpy copyto of the same 1 GiB into a warm
buffer) is measured between rounds, so both see the same machine state.

    python bench/weight_sync_bandwidth.py [--gib 1] [--bucket-mb 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time

import numpy as np
import torch
import zmq

GOAL = 0.5  # of memcpy


def rollout_process(address: str, stream_address: str, directory: str) -> None:
    from weight_sync.buckets import WeightManifest, read_manifest
    from weight_sync.stream import WeightPrefetcher

    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.connect(address)
    prefetcher = WeightPrefetcher(stream_address, directory)
    while True:
        message = socket.recv_json()
        if message is None:
            break
        started = time.perf_counter()
        manifest = WeightManifest.from_dict(message["weights_manifest"])
        if message["streamed"]:
            while not prefetcher.checked(manifest):
                time.sleep(0.0002)
        with read_manifest(manifest, verify=not message["streamed"]) as tensors:
            count = len(tensors)
        prefetcher.release()
        socket.send_json({"tensors": count, "after_manifest_s": time.perf_counter() - started})
    prefetcher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from weight_sync.buckets import ShmWeightWriter
    from weight_sync.stream import WeightStreamPublisher

    total = int(args.gib * (1 << 30))
    per_tensor = 4096 * 1024 * 4
    state = {f"layers.{i}.weight": torch.randn(4096, 1024) for i in range(total // per_tensor)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    source = np.random.default_rng(0).random(nbytes // 8)
    destination = np.empty_like(source)
    np.copyto(destination, source)

    directory = tempfile.mkdtemp(prefix="tether-bench-", dir="/dev/shm")
    address, stream_address = f"ipc://{directory}/control", f"ipc://{directory}/stream"
    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.bind(address)
    publisher = WeightStreamPublisher(stream_address)
    child = multiprocessing.get_context("spawn").Process(target=rollout_process, args=(address, stream_address, directory))
    child.start()
    writer = ShmWeightWriter(directory, bucket_bytes=args.bucket_mb << 20, slots=2)

    def sync(version: int, streamed: bool) -> tuple[float, float]:
        started = time.perf_counter()
        manifest = writer.publish(version, state.items(), publisher.announcer(version) if streamed else None)
        written = time.perf_counter()
        socket.send_json({"weights_manifest": manifest.to_dict(), "streamed": streamed})
        socket.recv_json()
        return time.perf_counter() - started, written - started

    def memcpy() -> float:
        started = time.perf_counter()
        np.copyto(destination, source)
        return time.perf_counter() - started

    first_total, _ = sync(1, streamed=False)  # fresh tmpfs pages: faults on first touch
    sync(2, streamed=False)  # the second slot warms up too
    results = {True: ([], []), False: ([], [])}
    copies = []
    for round_index in range(args.rounds):
        copies.append(memcpy())
        for streamed in (True, False):
            total_s, write_s = sync(3 + 2 * round_index + int(streamed), streamed)
            results[streamed][0].append(total_s)
            results[streamed][1].append(write_s)
    socket.send_json(None)
    child.join()
    writer.close(remove=True)
    publisher.close()

    gb = nbytes / 1e9
    memcpy_rate = gb / statistics.median(copies)
    print(f"weight sync of {nbytes / (1 << 30):.2f} GiB fp32 ({len(state)} tensors, {args.bucket_mb} MiB buckets), "
          f"learner -> rollout process, median of {args.rounds}:")
    print(f"  memcpy, same run                                  {memcpy_rate:6.2f} GB/s")
    print(f"  learner write + checksum                          {gb / statistics.median(results[True][1]):6.2f} GB/s")
    checked_after = gb / statistics.median(results[False][0])
    print(f"  end to end, rollout checks after the manifest     {checked_after:6.2f} GB/s "
          f"({checked_after / memcpy_rate:.0%} of memcpy)")
    streamed = gb / statistics.median(results[True][0])
    print(f"  end to end, rollout checks buckets as written     {streamed:6.2f} GB/s "
          f"({streamed / memcpy_rate:.0%} of memcpy)   <- what a run does")
    print(f"  first version, cold shared-memory pages           {gb / first_total:6.2f} GB/s")
    ratio = streamed / memcpy_rate
    print(f"  goal >= {GOAL:.0%} of memcpy: {'met' if ratio >= GOAL else 'NOT met'} ({ratio:.0%})")
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
