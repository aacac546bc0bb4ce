"""Data parallelism, checked by computing the same thing two ways: two PPO steps on the same
batches with 1 DeepSpeed rank and with 2 (gloo, started by torch.distributed's launcher), under
ZeRO-2 and ZeRO-3, end with the same actor weights (as published, bucket by bucket) and the same
logged losses. The passes are prefix trees (learner.packing's default) unless a test says none."""


import pytest

from tests.helpers import train_data_parallel

# float32 on both sides; the ranks' forward passes see other row counts and their gradients are
# summed in another order. Measured here with padded passes: 3.5e-7 (ZeRO-2) and 3.8e-7 (ZeRO-3)
# after two steps of 2 epochs x 2 minibatches at lr 1e-3; without the data-parallel loss scale the
# gap is 1.2e-2. With prefix trees (the default) each rank packs other rows together, so the
# attention kernel's shapes differ too, and Adam moves a weight by about lr whatever its gradient's
# size: measured 1.1e-5 and 1.2e-5 (1% of one step). The passes themselves agree within 1e-5,
# gradients included (tests/test_packing.py), and a step at lr 1e-4 within 1e-5.
WEIGHT_TOLERANCE = 3e-5


@pytest.mark.slow
@pytest.mark.parametrize("zero", [3])  # ZeRO-2: test_two_ranks_train_episodes_in_parts_as_one_rank_does
def test_two_ranks_train_the_same_weights_as_one(tmp_path, tiny_assets, one_rank, zero):
    two = train_data_parallel(tmp_path, tiny_assets, zero=zero, ranks=2)
    assert one_rank["world"] == 1 and two["world"] == 2
    assert set(two["actor"]) == set(one_rank["actor"])
    gap = max(float((two["actor"][name] - one_rank["actor"][name]).abs().max()) for name in one_rank["actor"])
    moved = max(float((one_rank["actor"][name] - initial).abs().max())
                for name, initial in _initial(tiny_assets).items() if name in one_rank["actor"])
    assert gap < WEIGHT_TOLERANCE, gap
    assert moved > 30 * WEIGHT_TOLERANCE  # the steps changed the weights: the agreement means something
    assert two["losses"] == pytest.approx(one_rank["losses"], abs=1e-5)
    assert two["buckets"] > 1  # published bucket by bucket
    if zero == 3:  # gathered one bucket (64 KiB here) at a time, never the whole model
        assert 0 < two["most_bytes_gathered"] <= 1 << 16 < two["model_bytes"], two["most_bytes_gathered"]


def _initial(assets) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets["policy"]).state_dict()


@pytest.mark.slow
def test_two_ranks_with_a_token_budget_train_the_same_weights_as_one_rank_without(tmp_path, tiny_assets, one_rank):
    """ZeRO-3, 2 ranks, micro-batches of at most 16 padded tokens (1 or 2 rows of 8 to 12 tokens,
    as many passes on both ranks: a ZeRO-3 forward is collective) against 1 rank, a minibatch a
    pass."""
    two = train_data_parallel(tmp_path, tiny_assets, 3, 2, "learner.max_tokens_per_microbatch=16", "rollout.max_model_len=16")
    gap = max(float((two["actor"][name] - one_rank["actor"][name]).abs().max()) for name in one_rank["actor"])
    assert gap < WEIGHT_TOLERANCE, gap
    assert two["losses"] == pytest.approx(one_rank["losses"], abs=1e-5)
    # each of 2 steps: the proximal pass over the rank's rows, then 2 epochs x 2 minibatches; a pass a
    # minibatch on one rank, and more, accumulated, on each of two under the budget
    assert len(two["passes"]) == len(one_rank["passes"]) == 2 * (1 + 2 * 2)
    assert one_rank["passes"][1:5] == [1, 1, 1, 1] and sum(two["passes"]) > sum(one_rank["passes"]), two["passes"]


@pytest.mark.slow
def test_two_ranks_train_episodes_in_parts_as_one_rank_does(tmp_path, tiny_assets):
    """ZeRO-2. Eight episodes in 11 rows (three in two parts): rows that do not split evenly between
    the ranks, and, one row a pass, a rank with a pass fewer than the other runs a filler pass (the
    backward's gradient reduction is collective) that trains nothing."""
    one = train_data_parallel(tmp_path, tiny_assets, 2, 1, "learner.micro_batch_size=1", parts=True)
    two = train_data_parallel(tmp_path, tiny_assets, 2, 2, "learner.micro_batch_size=1", parts=True)
    gap = max(float((two["actor"][name] - one["actor"][name]).abs().max()) for name in one["actor"])
    assert gap < WEIGHT_TOLERANCE, gap
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    # the proximal pass: 11 rows, one a pass on one rank; 6 on each of two (5 rows and a filler, 6 rows)
    assert one["passes"][0] == 11 and two["passes"][0] == 6
