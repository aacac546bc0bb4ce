"""How a rank's rows become micro-batches (training.micro_batches): by rows or by token budget,
like lengths together, every row once, as many passes on every rank."""

import torch

from training.micro_batches import deal, padded_tokens, plan, split_to

# a long-tailed batch: most sequences short, a few long (prompt + response tokens)
LENGTHS = torch.tensor([12, 70, 9, 14, 11, 40, 10, 13, 9, 66, 12, 10, 15, 11, 9, 30])


def rows_of(parts):
    return sorted(int(row) for part in parts for row in part)


def test_a_token_budget_packs_like_lengths_and_keeps_every_row_once():
    parts = plan(LENGTHS, max_tokens=64)
    assert rows_of(parts) == list(range(len(LENGTHS)))
    assert all(len(part) * int(LENGTHS[part].max()) <= 64 or len(part) == 1 for part in parts)
    # longest first, and no part holds a row longer than any row of the part before it
    assert [int(LENGTHS[part].max()) for part in parts] == sorted((int(LENGTHS[p].max()) for p in parts), reverse=True)
    # the two rows over the budget (70, 66) go alone; 4 x 15 tokens fill the next
    assert [len(part) for part in parts[:2]] == [1, 1] and int(LENGTHS[parts[0]]) == 70
    # the waste, padding computed for nothing: 15 + 5 + 4 tokens (in [30, 15], [14, 13, 12, 12],
    # [11, 11, 10, 10, 9]) by budget, against 175 + 86 + 167 + 55 in fixed parts of 4 rows
    real = int(LENGTHS.sum())
    fixed = list(torch.arange(len(LENGTHS)).split(4))
    assert padded_tokens(parts, LENGTHS) - real == 24
    assert padded_tokens(fixed, LENGTHS) - real == 483


def test_rows_alone_or_with_a_cap_and_no_limit_is_one_pass():
    assert [len(part) for part in plan(LENGTHS, max_rows=5)] == [5, 5, 5, 1]
    assert [len(part) for part in plan(LENGTHS)] == [16]
    both = plan(LENGTHS, max_rows=3, max_tokens=1000)
    assert max(len(part) for part in both) == 3 and rows_of(both) == list(range(16))


def test_a_rank_with_fewer_passes_splits_its_costliest_until_it_has_as_many():
    parts = plan(LENGTHS, max_tokens=200)
    more = split_to(parts, LENGTHS, len(parts) + 3)
    assert len(more) == len(parts) + 3 and rows_of(more) == list(range(16))
    assert split_to(parts, LENGTHS, len(parts)) == parts
    # more passes than rows (a rank dealt one row fewer than another): the rest are empty fillers
    fillers = split_to(parts, LENGTHS, 18)
    assert [len(part) for part in fillers[16:]] == [0, 0] and rows_of(fillers) == list(range(16))


def test_dealing_gives_each_rank_as_many_rows_of_like_lengths():
    rows = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    shares = [deal(rows, LENGTHS, rank, 2) for rank in range(2)]
    assert [len(share) for share in shares] == [8, 8]
    assert sorted(torch.cat(shares).tolist()) == list(range(16))
    # like lengths: each rank gets one of the two longest, and their totals differ by little (168, 173)
    assert {int(LENGTHS[share].max()) for share in shares} == {70, 66}
    assert abs(int(LENGTHS[shares[0]].sum()) - int(LENGTHS[shares[1]].sum())) == 5
    # rows that do not split evenly (episodes in parts): shares differ by one row, each row dealt once
    uneven = [deal(rows[:15], LENGTHS, rank, 4) for rank in range(4)]
    assert sorted(map(len, uneven)) == [3, 4, 4, 4] and sorted(torch.cat(uneven).tolist()) == sorted(rows[:15].tolist())
