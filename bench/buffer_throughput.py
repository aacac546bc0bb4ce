"""Buffer throughput and added latency: rollout -> buffer -> scorer -> buffer -> learner.

The buffer is the real role (``buffer.main.run``) in its own process; rollout, scorer and learner
are no-op stand-ins in their own processes that do nothing but move messages: 256-token samples
(64-token prompts), the scorer echoes them back with reference logprobs and a score, the learner
takes batches and publishes an empty weight version after each, so credits keep flowing under
``max_staleness``. Figures: samples/s reaching the learner, and the buffer's own handling time
per message (arrival to every reply it enables), p50/p99.

``--image-bytes 0,1000,30000``: one round per size, side by side, each sample carrying one image
of that many (encoded) bytes, as a policy that sees sends them (issue 36): 1000 is about the
vision demo's 56-pixel PNG, 30000 a 448-pixel JPEG photo. Each round also prints the bytes a
sample takes on the wire (the rollout's "samples" message, frames together, per sample).

    python bench/buffer_throughput.py [--samples 200000] [--batch 512] [--chunk 256] [--image-bytes 0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time

import numpy as np

GOAL_SAMPLES_PER_S = 20_000
GOAL_P99_MS = 5.0
PROMPT_TOKENS, RESPONSE_TOKENS = 64, 256


def make_config(run_dir: str, batch: int, chunk: int, staleness: int):
    from common.config import load_config

    return load_config(None, [f"learner.batch_size={batch}", f"learner.minibatch_size={batch}",
                              f"buffer.max_staleness={staleness}", f"scorer.max_samples_per_request={chunk}",
                              "log_level=WARNING"],
                       base={"run_dir": run_dir, "models": {"policy": "-", "reward": "-"}, "data": {"prompts": "-"}})


def buffer_process(config) -> None:
    from buffer.main import run

    run(config)


def template_sample(image_bytes: int):
    """The sample every message repeats: 64 prompt and 256 response tokens, and one image of
    ``image_bytes`` random bytes (0: none; the buffer never decodes an image)."""
    from common.images import pack_images
    from protocol.samples import Sample

    image = pack_images([np.random.default_rng(0).bytes(image_bytes)]) if image_bytes else None
    return Sample("r", 0, 0, np.ones(PROMPT_TOKENS, np.int32), np.ones(RESPONSE_TOKENS, np.int32),
                  np.full(RESPONSE_TOKENS, -1.0, np.float32), "stop", images=image)


def wire_bytes_per_sample(image_bytes: int, count: int = 256) -> float:
    """The rollout's "samples" message of ``count`` such samples, encoded: its frames' bytes per sample."""
    from protocol.codec import encode
    from protocol.samples import pack_samples

    fields, tensors = pack_samples([template_sample(image_bytes)] * count)
    fields = {**fields, "sample_ids": [f"r{i}" for i in range(count)], "prompt_indices": list(range(count)),
              "data_rows": list(range(count))}
    return sum(len(frame) for frame in encode("samples", fields, tensors)) / count


def rollout_process(config, chunk: int, total: int, image_bytes: int) -> None:
    from protocol.transport import BufferClient

    from protocol.samples import pack_samples

    client = BufferClient(config.buffer_address, "rollout", "0")
    client.connect(60, 0.5)
    sample = template_sample(image_bytes)
    version, sent, templates = 0, 0, {}
    while sent < total:
        grant = client.request("credit_request", {"policy_version": version, "wanted": chunk})
        if grant.fields["stop"]:
            break
        version = grant.fields["policy_version"]
        count = grant.fields["credits"]
        if count == 0:
            continue
        if count not in templates:  # packed once: the columns as Sample declares them, cheap to reuse
            templates[count] = pack_samples([sample] * count)
        fields, tensors = templates[count]
        indices = grant.fields["prompt_indices"]
        fields = {**fields, "sample_ids": [f"r{sent + i}" for i in range(count)], "prompt_indices": indices,
                  "data_rows": indices, "behavior_versions": [version] * count,
                  "last_behavior_versions": [version] * count}
        client.request("samples", fields, tensors)
        sent += count


def scorer_process(config, chunk: int) -> None:
    from protocol.transport import BufferClient

    client = BufferClient(config.buffer_address, "scorer", "0")
    client.connect(60, 0.5)
    while True:
        work = client.request("score_request", {"max_samples": chunk})
        if work.fields["stop"]:
            break
        fields = {key: value for key, value in work.fields.items() if key != "stop"}
        tensors = dict(work.tensors)
        tensors["ref_logprobs"] = tensors["behavior_logprobs"]
        tensors["rewards"] = np.zeros(len(fields["sample_ids"]), np.float32)
        client.request("scored", fields, tensors)


def learner_process(config, batch: int, total: int, out: str) -> None:
    from protocol.transport import BufferClient

    client = BufferClient(config.buffer_address, "learner", "0")
    client.connect(60, 0.5)
    received, version, started = 0, 0, None
    while received < total:
        reply = client.request("batch_request", {"policy_version": version, "batch_size": batch,
                                                  "max_staleness": config.buffer.initial_staleness})
        if started is None:
            started, first = time.perf_counter(), len(reply.fields["sample_ids"])
        received += len(reply.fields["sample_ids"])
        version += 1
        client.request("weights_published", {"policy_version": version, "weights_manifest": {"policy_version": version, "buckets": []}})
    elapsed = time.perf_counter() - started
    client.request("finish", {"policy_version": version})
    with open(out, "w") as file:
        json.dump({"samples": received - first, "seconds": elapsed}, file)


def one_round(args, image_bytes: int) -> tuple[float, dict]:
    """One run of the four processes: (samples/s reaching the learner, the buffer's accounting)."""
    run_dir = tempfile.mkdtemp(prefix="tether-bench-buffer-")
    config = make_config(run_dir, args.batch, args.chunk, args.max_staleness)
    out = os.path.join(run_dir, "learner.json")
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=buffer_process, args=(config,)),
                 spawn.Process(target=scorer_process, args=(config, args.chunk)),
                 spawn.Process(target=rollout_process, args=(config, args.chunk, args.samples + args.batch * 4,
                                                             image_bytes)),
                 spawn.Process(target=learner_process, args=(config, args.batch, args.samples, out))]
    for process in processes:
        process.start()
    while processes[-1].is_alive():  # a role that dies ends the bench instead of leaving the others waiting
        processes[-1].join(timeout=1.0)
        dead = [p for p in processes[:-1] if p.exitcode not in (None, 0)]
        if dead:
            for process in processes:
                process.terminate()
            raise SystemExit(f"a bench process died (exit {dead[0].exitcode}); see its traceback above")
    for process in processes[:-1]:
        process.join(timeout=60)
        if process.is_alive():
            process.terminate()
    with open(out) as file:
        learner = json.load(file)
    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    return learner["samples"] / learner["seconds"], accounting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--image-bytes", default="0", help="comma-separated: one round per size, side by side")
    args = parser.parse_args()

    for image_bytes in (int(size) for size in args.image_bytes.split(",")):
        rate, accounting = one_round(args, image_bytes)
        image = f", one {image_bytes:,}-byte image each" if image_bytes else ""
        print(f"buffer throughput, {RESPONSE_TOKENS}-token samples{image}, batch {args.batch}, chunks of "
              f"{args.chunk}, max_staleness {args.max_staleness}:")
        print(f"  {rate:,.0f} samples/s through rollout -> buffer -> scorer -> buffer -> learner "
              f"(goal >= {GOAL_SAMPLES_PER_S:,}: {'met' if rate >= GOAL_SAMPLES_PER_S else 'NOT met'}); "
              f"{wire_bytes_per_sample(image_bytes):,.0f} bytes a sample on the wire")
        p99 = accounting["handling_ms_p99"]
        print(f"  buffer handling per message: p50 {accounting['handling_ms_p50']:.2f} ms, p99 {p99:.2f} ms, "
              f"max {accounting['handling_ms_max']:.2f} ms over {accounting['messages_handled']} messages "
              f"(goal p99 < {GOAL_P99_MS} ms: {'met' if p99 < GOAL_P99_MS else 'NOT met'})")
        print(f"  accounting: generated {accounting['generated']}, trained {accounting['trained']}, "
              f"in flight {accounting['in_flight']}, identity holds: {accounting['identity_holds']}, "
              f"staleness violations {accounting['staleness_violations']}")


if __name__ == "__main__":
    main()
