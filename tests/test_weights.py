"""Weight sync buckets in shared memory: complete and checked, or refused; never a mix."""

import os

import pytest
import torch

from protocol.codec import ProtocolError
from weight_sync.buckets import BucketEntry, ShmWeightWriter, WeightManifest, WeightStreamError, read_manifest


def state(seed):
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=generator),
        "layer.bias": torch.randn(7, generator=generator).to(torch.bfloat16),
        "big.weight": torch.randn(300, 100, generator=generator),  # 120 KB: larger than one bucket
        "steps": torch.tensor([seed, 2 * seed], dtype=torch.int64),
    }


def assert_equal_state(tensors, expected):
    assert set(tensors) == set(expected)
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name


def test_a_version_round_trips_through_buckets(tmp_path):
    writer = ShmWeightWriter(str(tmp_path), bucket_bytes=16 * 1024)
    manifest = writer.publish(1, state(1).items())
    assert len(manifest.buckets) >= 3
    oversized = [b for b in manifest.buckets if any(t.name == "big.weight" for t in b.tensors)]
    assert len(oversized) == 1 and len(oversized[0].tensors) == 1 and oversized[0].nbytes == 120_000
    # the manifest crosses the wire as a plain dict and is validated on arrival
    received = WeightManifest.from_dict(manifest.to_dict())
    with read_manifest(received) as tensors:
        assert_equal_state(tensors, state(1))


@pytest.mark.parametrize("damage, reason", [
    ("flip", "bucket 2 fails its checksum"),
    ("truncate", "bucket 2 has 119999 bytes, expected 120000"),
    ("delete", "bucket 2 missing"),
])
def test_a_damaged_bucket_refuses_the_whole_version(tmp_path, damage, reason):
    writer = ShmWeightWriter(str(tmp_path), bucket_bytes=8192)
    manifest = writer.publish(3, state(3).items())
    path = manifest.buckets[2].path
    if damage == "flip":
        with open(path, "r+b") as file:
            file.seek(100)
            byte = file.read(1)
            file.seek(100)
            file.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, manifest.buckets[2].nbytes - 1)
    else:
        os.remove(path)
    with pytest.raises(WeightStreamError, match=f"version 3: {reason}"):
        with read_manifest(manifest):
            pass


def test_slots_rotate_and_a_late_reader_is_refused(tmp_path):
    writer = ShmWeightWriter(str(tmp_path), bucket_bytes=1 << 20, slots=2)
    first = writer.publish(1, state(1).items())
    second = writer.publish(2, state(2).items())
    third = writer.publish(3, state(3).items())  # reuses the slot of version 1, never that of 2
    slot = lambda manifest: os.path.dirname(manifest.buckets[0].path)
    assert slot(first) == slot(third) != slot(second)
    with pytest.raises(WeightStreamError, match="version 1: bucket 0 fails its checksum"):
        with read_manifest(first):
            pass
    with read_manifest(second) as tensors:
        assert_equal_state(tensors, state(2))


def test_a_version_being_read_is_never_overwritten(tmp_path):
    writer = ShmWeightWriter(str(tmp_path), bucket_bytes=1 << 20, slots=2)
    first = writer.publish(1, state(1).items())
    writer.publish(2, state(2).items())
    with read_manifest(first) as tensors:  # a reader holds version 1's slot
        third = writer.publish(3, state(3).items())
        fourth = writer.publish(4, state(4).items())
        assert_equal_state(tensors, state(1))  # untouched while it is read
    assert len({os.path.dirname(m.buckets[0].path) for m in (first, third, fourth)}) == 3
    with read_manifest(fourth) as tensors:
        assert_equal_state(tensors, state(4))


@pytest.mark.parametrize("manifest", [
    {"policy_version": 1},
    {"policy_version": 1, "buckets": [{"index": 1, "nbytes": 8, "checksum": "x", "path": "/p", "tensors": []}]},
    {"policy_version": 1, "buckets": [{"index": 0, "nbytes": 8, "checksum": "x", "path": "/p",
                                "tensors": [["w", "float32", [4], 0]]}]},  # 16 bytes in an 8-byte bucket
    {"policy_version": 1, "buckets": [{"index": 0, "nbytes": 8, "checksum": "x", "path": "/p",
                                "tensors": [["w", "complex128", [1], 0]]}]},
])
def test_malformed_manifests_are_refused(manifest):
    with pytest.raises(ProtocolError, match="malformed weight manifest"):
        WeightManifest.from_dict(manifest)


# --------------------------------------------------------------------------- across hosts: TCP frames


def test_buckets_travel_over_tcp_into_the_readers_own_slots(tmp_path, served):
    from weight_sync.tcp import fetch_over_tcp

    writer, server = served
    manifest = writer.publish(5, state(5).items())
    staging = ShmWeightWriter(str(tmp_path / "rollout"), bucket_bytes=1)
    local = fetch_over_tcp(WeightManifest.from_dict(manifest.to_dict()), server.address, staging)
    assert all(b.path.startswith(str(tmp_path / "rollout")) for b in local.buckets)
    with read_manifest(local) as tensors:
        assert_equal_state(tensors, state(5))


def test_a_bucket_damaged_at_the_source_or_a_version_gone_is_refused(tmp_path, served):
    from weight_sync.tcp import fetch_over_tcp

    writer, server = served
    manifest = writer.publish(1, state(1).items())
    staging = ShmWeightWriter(str(tmp_path / "rollout"), bucket_bytes=1)
    writer.slot_of(1).payload(2)[:4] = 0  # damage after the checksum was taken
    with pytest.raises(WeightStreamError, match="version 1: bucket 2 fails its checksum"):
        fetch_over_tcp(manifest, server.address, staging)
    writer.publish(2, state(2).items())
    writer.publish(3, state(3).items())  # version 1's slot is reused
    with pytest.raises(WeightStreamError, match="version 1 is no longer held"):
        fetch_over_tcp(manifest, server.address, staging)
    assert server.refused == 1
    latest = writer.slot_of(3).manifest
    with read_manifest(fetch_over_tcp(latest, server.address, staging)) as tensors:  # still serving
        assert_equal_state(tensors, state(3))


# --------------------------------------------------------------------------- checked while written


def wait_until(condition, timeout_s=5.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_version_is_checked_while_written_and_its_slot_held_until_loaded(tmp_path, stream):
    publisher, prefetcher = stream
    writer = ShmWeightWriter(str(tmp_path / "w"), bucket_bytes=16 * 1024, slots=2)
    first = writer.publish(1, state(1).items(), publisher.announcer(1))
    assert wait_until(lambda: prefetcher.checked(first))  # pins version 1's slot
    second = writer.publish(2, state(2).items(), publisher.announcer(2))
    third = writer.publish(3, state(3).items(), publisher.announcer(3))
    slot = lambda manifest: os.path.dirname(manifest.buckets[0].path)
    assert slot(third) not in (slot(first), slot(second))  # version 1 is pinned: a third slot appears
    with read_manifest(first, verify=False) as tensors:  # loaded without a second check, still whole
        assert_equal_state(tensors, state(1))
    prefetcher.release()
    assert wait_until(lambda: prefetcher.checked(third))
    prefetcher.release()
    fourth = writer.publish(4, state(4).items())
    assert slot(fourth) == slot(first)  # released: reusable again


def test_a_bad_or_missed_bucket_leaves_the_version_to_the_full_check(tmp_path, stream):
    publisher, prefetcher = stream
    writer = ShmWeightWriter(str(tmp_path / "w"), bucket_bytes=16 * 1024)
    announce = publisher.announcer(1)
    lying = lambda total, bucket: announce(total, BucketEntry(bucket.index, bucket.nbytes, "0" * 16, bucket.path,
                                                                bucket.tensors))
    manifest = writer.publish(1, state(1).items(), lying)
    assert not wait_until(lambda: prefetcher.checked(manifest), timeout_s=1.0)
    silent = writer.publish(2, state(2).items())  # no notices at all
    assert not prefetcher.checked(silent)
    with read_manifest(silent) as tensors:  # the reader's own check still admits it
        assert_equal_state(tensors, state(2))


def test_a_manifest_naming_a_file_outside_the_weight_directory_is_refused_unread(tmp_path, stream):
    """A manifest is a message: whoever speaks as the learner could name any file of the host."""
    from weight_sync.buckets import outside

    publisher, prefetcher = stream
    writer = ShmWeightWriter(str(tmp_path / "w"), bucket_bytes=16 * 1024)
    manifest = writer.publish(1, state(1).items())
    assert outside(manifest, str(tmp_path / "w")) is None
    os.symlink("/etc", tmp_path / "w" / "etc")
    for path in ("/etc/passwd", str(tmp_path / "w" / ".." / "elsewhere"), str(tmp_path / "w" / "etc" / "passwd"),
                 str(tmp_path / "w-other" / "slot0" / "bucket00000")):
        foreign = WeightManifest(2, [*manifest.buckets[:1], BucketEntry(1, 10, "0" * 16, path, [])])
        assert outside(foreign, str(tmp_path / "w")) == (f"version 2: bucket 1 lies at {path}, outside this run's "
                                                         f"weight directory {tmp_path / 'w'}: refused")
    # the prefetcher neither maps nor locks an announced bucket outside its directory
    publisher.announcer(3)(1, BucketEntry(0, os.path.getsize("/etc/passwd"), "0" * 16, "/etc/passwd", []))
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    publisher.announcer(4)(1, BucketEntry(0, 0, "0" * 16, str(elsewhere / "bucket00000"), []))
    foreign = WeightManifest(4, [BucketEntry(0, 0, "0" * 16, str(elsewhere / "bucket00000"), [])])
    assert not wait_until(lambda: prefetcher.checked(foreign), timeout_s=0.5)
    assert not elsewhere.exists()  # no lock file was created there


def test_a_tied_tensor_is_published_once_under_its_first_name():
    """GPT-2 ties lm_head to the input embedding: save_pretrained writes it once, and vLLM's models
    that tie it have no `lm_head` parameter to load (Bloom refused every reload). Untied weights
    that merely hold equal values stay separate."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from weight_sync.buckets import without_tied_duplicates

    tied = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=32, n_layer=1, n_head=2, n_positions=16))
    for named in (tied.state_dict().items(), tied.state_dict(keep_vars=True).items()):
        names = [name for name, _ in without_tied_duplicates(named)]
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names
        assert len(names) == len(tied.state_dict()) - 1
    equal_values = [("a", torch.zeros(3)), ("b", torch.zeros(3))]
    assert [name for name, _ in without_tied_duplicates(equal_values)] == ["a", "b"]
