"""Publishing the actor's weights of a policy version as checked buckets (``weight_sync``), from
every rank: under ZeRO-3 a bucket's parameters are gathered at a time."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import zmq

from common.config import TetherConfig
from training.lora import merged_named_tensors
from weight_sync.buckets import ShmWeightWriter, WeightManifest, plan_buckets, without_tied_duplicates
from weight_sync.lora import adapter_named_tensors


def publish_weights(engine, version: int, writer: ShmWeightWriter | None, on_bucket=None,
                    bucket_bytes: int | None = None, adapters: bool = False) -> WeightManifest | None:
    """Write the actor's weights for ``version`` into shared memory as checked buckets; the
    returned manifest is what the rollout needs to find and verify them. Called on every rank:
    rank 0 (``writer`` given) writes, the others only take part in the gathers (and plan the same
    buckets: ``bucket_bytes``, the writer's). Under ZeRO-3 the
    parameters of one bucket at a time are gathered, so no rank holds the whole model twice.
    ``adapters``: a LoRA actor's adapters alone (``learner.lora_sync``)."""
    import deepspeed

    if engine.zero_optimization_stage() != 3:  # whole on rank 0; LoRA (never with ZeRO-3): merged there only
        if writer is None:
            return None
        named = (adapter_named_tensors(engine.module) if adapters
                 else without_tied_duplicates(merged_named_tensors(engine.module)))
        return writer.publish(version, named, on_bucket)
    named = without_tied_duplicates(engine.module.state_dict(keep_vars=True).items())
    # a partitioned parameter's full shape is ds_shape; its data is empty until gathered
    layout = plan_buckets([(name, getattr(t, "ds_shape", t.shape), t.dtype) for name, t in named],
                          writer.bucket_bytes if writer is not None else bucket_bytes)
    tensors = dict(named)

    @contextmanager
    def open_bucket(entries):
        partitioned = {id(tensors[e.name]): tensors[e.name] for e in entries if hasattr(tensors[e.name], "ds_id")}
        with deepspeed.zero.GatheredParameters(list(partitioned.values()), modifier_rank=None):
            yield {e.name: tensors[e.name].data for e in entries}

    if writer is not None:
        return writer.publish_buckets(version, layout, open_bucket, on_bucket)
    for entries in layout:  # the other ranks: the same gathers, in the same order
        with open_bucket(entries):
            pass
    return None


class WeightPublisher:
    """Where the learner's versions go: on rank 0 the shared-memory slots with bucket notices for the
    rollouts on this host, and a weight server for those on other hosts as well
    (``transport.weight_transport: tcp``; a pool may have both); every rank takes part in
    ``publish`` (the gathers of ZeRO-3 are collective)."""

    def __init__(self, config: TetherConfig, main: bool) -> None:
        from weight_sync.stream import WeightStreamPublisher
        from weight_sync.tcp import WeightServer

        transport = config.transport
        self.bucket_bytes = transport.weight_bucket_mb << 20
        self.writer = self.server = self.stream = None
        self.adapters = False
        if not main:
            return
        if config.learner.lora_rank:  # rank 0 alone publishes: only it asks vLLM (an import of seconds)
            from weight_sync.lora import lora_sync_logged

            self.adapters = lora_sync_logged(config, logging.getLogger("learner")) == "adapters"
        self.writer = ShmWeightWriter(config.weights_dir, self.bucket_bytes, transport.weight_slots)
        if transport.weight_transport == "tcp":  # rollouts on other hosts fetch the buckets from here
            self.server = WeightServer(self.writer, transport.weights_address, transport.max_frame_bytes,
                                       transport.curve)
        # rollouts on this host check each bucket as soon as it is written
        try:
            self.stream = WeightStreamPublisher(config.weights_stream_address)
        except zmq.ZMQError as error:
            if self.server is None:
                raise
            # with a weight server this host's rollouts are the extra: they read whole versions unannounced
            logging.getLogger("learner").warning("no bucket notices for this host's rollouts (%s: %s)",
                                                 config.weights_stream_address, error)

    def publish(self, engine, policy_version: int, client) -> None:
        """Write ``policy_version`` of the actor and tell the buffer (rank 0, ``client`` given)."""
        announcer = self.stream.announcer(policy_version) if self.stream is not None else None
        manifest = publish_weights(engine, policy_version, self.writer, announcer, self.bucket_bytes, self.adapters)
        if client is not None and manifest is not None:  # None: this rank writes nothing (or a replay)
            client.request("weights_published", {"policy_version": policy_version,
                                                 "weights_manifest": manifest.to_dict()})

    def close(self) -> None:
        """The run is over: nobody will load these versions."""
        for channel in (self.server, self.stream):
            if channel is not None:
                channel.close()
        if self.writer is not None:
            self.writer.close(remove=True)
