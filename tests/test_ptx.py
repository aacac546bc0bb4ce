"""PPO-ptx's text stream (learner.ptx): a seeded shuffle per pass that a resume finds again."""


def test_the_ptx_stream_is_a_seeded_shuffle_per_pass_that_a_resume_finds_again():
    from learner.ptx import PtxStream

    sequences = [[i, i + 1] for i in range(5)]
    stream = PtxStream(sequences, batch_size=3, seed=7)
    batches = [stream.next_batch()[0][:, 0].tolist() for _ in range(4)]  # 12 rows: 2 passes and 2 rows
    assert sorted(batches[0] + batches[1][:2]) == list(range(5)) == sorted(batches[1][2:] + batches[2] + batches[3][:1])
    resumed = PtxStream(sequences, batch_size=3, seed=7)
    resumed.position = 6  # where a resumed learner puts it: two batches in
    assert [resumed.next_batch()[0][:, 0].tolist() for _ in range(2)] == batches[2:]
