"""The wire format: round trips, and every kind of bad message refused with the reason."""

import msgpack
import numpy as np
import pytest

from protocol.codec import ProtocolError, decode, encode
from protocol.samples import pack_samples, unpack_samples
from protocol.schema import SCHEMA_VERSION
from tests.helpers import random_sample


def test_samples_round_trip_through_frames():
    samples = [random_sample(i, prompt_len=2 + i, resp_len=1 + 2 * i, scored=True) for i in range(4)]
    fields, tensors = pack_samples(samples, scored=True)
    frames = encode("scored", fields, tensors, msg_id=7)
    assert len(frames) == 1 + 5  # envelope + one raw frame per tensor, nothing pickled
    message = decode([bytes(frame) for frame in frames])
    assert message.type == "scored" and message.id == 7
    for before, after in zip(samples, unpack_samples(message)):
        assert after.sample_id == before.sample_id and after.behavior_version == before.behavior_version
        np.testing.assert_array_equal(after.prompt_tokens, before.prompt_tokens)
        np.testing.assert_array_equal(after.response_tokens, before.response_tokens)
        np.testing.assert_array_equal(after.behavior_logprobs, before.behavior_logprobs)
        np.testing.assert_array_equal(after.ref_logprobs, before.ref_logprobs)
        assert after.reward == before.reward and after.finish_reason == before.finish_reason


def _envelope(**changes):
    envelope = {"schema": SCHEMA_VERSION, "type": "ack", "id": 1, "fields": {"accepted": 1}, "tensors": []}
    envelope.update(changes)
    return [msgpack.packb(envelope)]


def test_the_sample_messages_carry_the_columns_the_sample_declares():
    from protocol.samples import COLUMNS, LENGTHS
    from protocol.schema import MESSAGES

    for message, scored in (("samples", False), ("score_work", False), ("scored", True), ("batch", True)):
        declared = {**MESSAGES[message].fields, **MESSAGES[message].tensors}
        for column in COLUMNS:
            assert (column.wire in declared) == (scored or not column.scored), (message, column.wire)
        assert set(LENGTHS.values()) <= set(MESSAGES[message].fields)
    # each column travels under its own name: a field list per sample, or a flat tensor
    assert MESSAGES["scored"].fields["gold_rewards"] == "list[float]?"
    assert MESSAGES["scored"].tensors == {"prompt_tokens": "int32", "response_tokens": "int32",
                                          "behavior_logprobs": "float32", "ref_logprobs": "float32",
                                          "teacher_logprobs": "float32?", "rewards": "float32", "loss_mask": "uint8?",
                                          "turn_rewards": "float32?", "image_bytes": "uint8?"}
    assert MESSAGES["scored"].fields["part_indices"] == "list[int]?"


@pytest.mark.parametrize("frames, reason", [
    ([b"\xc1\xc1 not msgpack"], "not valid msgpack"),
    ([msgpack.packb([1, 2])], "not a map"),
    (_envelope(schema=99), f"peer speaks schema version 99, this process speaks {SCHEMA_VERSION}"),
    (_envelope(type="launch_missiles"), "unknown message type 'launch_missiles'"),
    (_envelope(fields={}), "missing field 'accepted'"),
    (_envelope(fields={"accepted": "1"}), "field 'accepted' must be int"),
    (_envelope(fields={"accepted": 1, "extra": 2}), "unknown field"),
    (_envelope(tensors=[["x", "float32", [1]]]), "declares 1 tensors but 0 frames"),
    ([], "empty message"),
])
def test_bad_envelopes_are_refused_with_the_reason(frames, reason):
    with pytest.raises(ProtocolError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        decode(frames)


def _samples_frames():
    fields, tensors = pack_samples([random_sample(0), random_sample(1)])
    return encode("samples", fields, tensors)


def test_wrong_dtype_and_wrong_byte_count_are_refused():
    frames = _samples_frames()
    envelope = msgpack.unpackb(frames[0])
    envelope["tensors"][0][1] = "float32"  # prompt_tokens must be int32
    with pytest.raises(ProtocolError, match="prompt_tokens' must be int32, got float32"):
        decode([msgpack.packb(envelope)] + frames[1:])
    truncated = list(frames)
    truncated[2] = bytes(frames[2])[:-4]
    with pytest.raises(ProtocolError, match="response_tokens' of shape \\[8\\] int32 needs 32 bytes, got 28"):
        decode(truncated)


def test_frames_over_the_limit_are_refused():
    frames = _samples_frames()
    with pytest.raises(ProtocolError, match="over the limit of 16"):
        decode(frames, max_frame_bytes=16)


def test_inconsistent_sample_lengths_and_nan_are_refused():
    fields, tensors = pack_samples([random_sample(0), random_sample(1)])
    fields["response_lengths"] = [4, 5]
    with pytest.raises(ProtocolError, match="response_tokens has shape \\(8,\\), lengths add to 9"):
        unpack_samples(decode(encode("samples", fields, tensors)))
    fields, tensors = pack_samples([random_sample(0)])
    tensors["behavior_logprobs"][1] = np.nan
    with pytest.raises(ProtocolError, match="behavior_logprobs holds NaN"):
        unpack_samples(decode(encode("samples", fields, tensors)))


def test_sender_refuses_to_send_what_the_receiver_would_refuse():
    with pytest.raises(ProtocolError, match="missing field 'accepted'"):
        encode("ack", {})


def test_repacking_received_samples_in_any_order_gives_the_same_bytes():
    """Samples of a received message are re-sent by slicing runs of consecutive rows; whatever the
    order or mix, and after an array is replaced, the packed tensors equal a plain concatenation."""
    originals = [random_sample(i, prompt_len=1 + i % 3, resp_len=2 + i % 5, scored=True) for i in range(12)]
    received = []
    for part in (originals[:7], originals[7:]):
        received += unpack_samples(decode(encode("scored", *pack_samples(part, scored=True))))
    received[4].ref_logprobs = np.full(len(received[4].response_tokens), -9.0, np.float32)
    originals[4].ref_logprobs = received[4].ref_logprobs
    for order in (list(range(12)), [0, 1, 2, 8, 9, 3, 4, 10, 11, 5, 6, 7], list(reversed(range(12)))):
        got_fields, got = pack_samples([received[i] for i in order], scored=True)
        want_fields, want = pack_samples([originals[i] for i in order], scored=True)
        assert got_fields == want_fields
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_an_episodes_masks_travel_and_are_left_out_where_no_sample_has_them():
    single = [random_sample(i) for i in range(2)]
    fields, tensors = pack_samples(single)
    assert "loss_mask" not in tensors and "turn_rewards" not in tensors  # single responses pay nothing
    assert all(s.loss_mask is None for s in unpack_samples(decode(encode("samples", fields, tensors))))

    episode = random_sample(2, resp_len=5)
    episode.loss_mask = np.array([1, 1, 0, 0, 1], np.uint8)  # a turn, an observation, a turn
    episode.turn_rewards = np.array([0, 0.5, 0, 0, 0], np.float32)
    received = unpack_samples(decode(encode("samples", *pack_samples([single[0], episode]))))
    np.testing.assert_array_equal(received[1].loss_mask, episode.loss_mask)
    np.testing.assert_array_equal(received[1].turn_rewards, episode.turn_rewards)
    # a sample of the same message without them: all its tokens the policy's, no turn reward
    np.testing.assert_array_equal(received[0].loss_mask, np.ones(4, np.uint8))
    np.testing.assert_array_equal(received[0].turn_rewards, np.zeros(4, np.float32))


@pytest.mark.parametrize("loss_mask, turn_rewards, reason", [
    ([0, 0, 0, 0], None, "a sample's loss_mask has no policy token"),
    ([1, 2, 1, 1], None, "loss_mask holds values other than 0 and 1"),
    ([1, 0, 1, 1], [0, 1, 0, 0], "a turn reward sits on an environment token"),
])
def test_an_episode_that_cannot_be_trained_is_refused(loss_mask, turn_rewards, reason):
    sample = random_sample(0)
    sample.loss_mask = np.array(loss_mask, np.uint8)
    sample.turn_rewards = None if turn_rewards is None else np.array(turn_rewards, np.float32)
    with pytest.raises(ProtocolError, match=reason):
        unpack_samples(decode(encode("samples", *pack_samples([random_sample(1), sample]))))


def test_an_episodes_parts_travel_with_their_numbers_and_are_refused_when_they_do_not_add_up():
    from protocol.samples import group_is_whole

    parts = [random_sample(i) for i in range(3)]  # episode 0 in two parts, episode 1 in one
    for sample, (episode, part, count) in zip(parts, [(0, 0, 2), (0, 1, 2), (1, 0, 1)]):
        sample.prompt_index, sample.episode_index, sample.part_index, sample.episode_parts = 5, episode, part, count
    received = unpack_samples(decode(encode("samples", *pack_samples(parts))))
    assert [(s.episode_index, s.part_index, s.episode_parts, s.final) for s in received] == [
        (0, 0, 2, False), (0, 1, 2, True), (1, 0, 1, True)]
    assert received[0].episode == received[1].episode != received[2].episode
    assert group_is_whole(received, 2) and not group_is_whole(received[1:], 2) and not group_is_whole(received, 3)
    assert not group_is_whole([*received, received[0]], 2)  # a part twice is not a whole group
    # single responses carry none of the three: each is one whole episode
    single = unpack_samples(decode(encode("samples", *pack_samples([random_sample(7), random_sample(8)]))))
    assert all(s.final and s.episode_index is None for s in single) and group_is_whole(single, 2)
    # a message where one sample lacks them sends none of them: its samples read as one part each
    mixed = unpack_samples(decode(encode("samples", *pack_samples([parts[0], random_sample(9)]))))
    assert all(s.episode_index is None and s.final for s in mixed)

    fields, tensors = pack_samples(parts)
    with pytest.raises(ProtocolError, match="part_index is not within its episode_parts"):
        unpack_samples(decode(encode("samples", {**fields, "part_indices": [0, 2, 0]}, tensors)))
    with pytest.raises(ProtocolError, match="come together or not at all"):
        unpack_samples(decode(encode("samples", {**fields, "episode_parts": None}, tensors)))


def test_a_samples_images_travel_as_bytes_and_a_message_without_any_carries_none():
    from common.images import pack_images, unpack_images

    text = [random_sample(i, scored=True) for i in range(2)]
    fields, tensors = pack_samples(text, scored=True)
    assert "image_bytes" not in tensors and "image_byte_lengths" not in fields  # text pays nothing
    assert all(s.images is None for s in unpack_samples(decode(encode("scored", fields, tensors))))

    seen = random_sample(2, scored=True)
    seen.images = pack_images([b"\x89PNG one", b"\x89PNG two, longer"])
    received = unpack_samples(decode(encode("scored", *pack_samples([text[0], seen, text[1]], scored=True))))
    assert received[0].images is None and received[2].images is None
    assert unpack_images(received[1].images) == [b"\x89PNG one", b"\x89PNG two, longer"]
    np.testing.assert_array_equal(received[1].response_tokens, seen.response_tokens)  # the tokens still line up
    again = unpack_samples(decode(encode("scored", *pack_samples(received, scored=True))))  # re-sent as received
    assert unpack_images(again[1].images) == [b"\x89PNG one", b"\x89PNG two, longer"] and again[0].images is None
    fields, tensors = pack_samples([seen], scored=True)
    with pytest.raises(ProtocolError, match="image_bytes has shape"):
        unpack_samples(decode(encode("scored", {**fields, "image_byte_lengths": [3]}, tensors)))
    fields, tensors = pack_samples([text[0], seen], scored=True)
    total = sum(fields["image_byte_lengths"])
    with pytest.raises(ProtocolError, match="a negative length"):  # lengths that add up, one of them below 0
        unpack_samples(decode(encode("scored", {**fields, "image_byte_lengths": [-5, total + 5]}, tensors)))


def test_a_kept_batch_of_an_older_schema_decodes_where_the_batch_has_not_changed_since():
    """A recorded batch (learner.record_batches) outlives protocol changes to other messages: it
    decodes from the version its fields last changed at (``UNCHANGED_SINCE``); a live message of any
    other version, and a kept one older than that, are refused."""
    from protocol.samples import pack_samples
    from protocol.schema import UNCHANGED_SINCE

    fields, tensors = pack_samples([random_sample(0, scored=True)], scored=True)
    frames = encode("batch", {**fields, "stop": False}, tensors)
    since = UNCHANGED_SINCE["batch"]
    for version, kept, taken in [(since, True, True), (SCHEMA_VERSION, True, True), (since - 1, True, False),
                                 (since, False, SCHEMA_VERSION == since), (SCHEMA_VERSION + 1, True, False)]:
        envelope = msgpack.unpackb(frames[0])
        envelope["schema"] = version
        written = [msgpack.packb(envelope, use_bin_type=True), *frames[1:]]
        if taken:
            assert decode(written, kept=kept).fields["sample_ids"] == fields["sample_ids"]
        else:
            with pytest.raises(ProtocolError, match=f"peer speaks schema version {version}, "):
                decode(written, kept=kept)
    with pytest.raises(ProtocolError, match="a kept ack message: from version"):
        decode(_envelope(schema=SCHEMA_VERSION - 1), kept=True)  # no message but the batch is kept


def test_a_message_where_some_samples_lack_teacher_logprobs_is_refused_not_trained_as_probability_1():
    """A teacher's logprob of 0 is a probability of 1: a sample without the column beside one with it
    (a buffer resumed with models.teacher added) must not travel as zeros."""
    import numpy as np

    from protocol.message import Message
    from protocol.samples import pack_samples, unpack_samples
    from tests.helpers import sample_of

    taught, untaught = sample_of([1, 2], [3, 4, 5], "a", reward=0.0), sample_of([1, 2], [6, 2], "b", reward=0.0)
    taught.teacher_logprobs = np.array([-0.5, -0.25, -1.0], np.float32)
    fields, tensors = pack_samples([taught, untaught], scored=True)
    with pytest.raises(ProtocolError, match="teacher_logprobs holds NaN"):
        unpack_samples(Message("scored", fields, tensors))
    fields, tensors = pack_samples([taught], scored=True)
    assert unpack_samples(Message("scored", fields, tensors))[0].teacher_logprobs.tolist() == [-0.5, -0.25, -1.0]
