"""How a rank's rows become micro-batches (training.micro_batches): by rows or by token budget,
like lengths together, every row once, as many passes on every rank."""

import torch

from training.micro_batches import deal, deal_in_order, padded_tokens, plan, split_to

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


def test_a_packed_budget_counts_the_tokens_a_pass_computes():
    """Packed (``shared`` zeros) a pass holds rows up to the budget's sum of lengths; as a tree, a row
    costs only the tokens past what it shares with the row before it."""
    order = torch.argsort(LENGTHS, descending=True, stable=True)
    packed = plan(LENGTHS, max_tokens=80, shared=torch.zeros_like(LENGTHS), order=order)
    assert rows_of(packed) == list(range(len(LENGTHS)))
    assert all(int(LENGTHS[part].sum()) <= 80 or len(part) == 1 for part in packed)
    # each pass as full as the next row allows: it would pass the budget
    assert all(int(LENGTHS[a].sum() + LENGTHS[b[0]]) > 80 for a, b in zip(packed, packed[1:]))
    # a tree: four rows of 30 tokens, each sharing 25 with the one before it, cost 30 + 3 x 5
    tree = plan(torch.full((4,), 30), max_tokens=45, shared=torch.tensor([0, 25, 25, 25]), order=torch.arange(4))
    assert [part.tolist() for part in tree] == [[0, 1, 2, 3]]
    tree = plan(torch.full((4,), 30), max_tokens=44, shared=torch.tensor([0, 25, 25, 25]), order=torch.arange(4))
    assert [part.tolist() for part in tree] == [[0, 1, 2], [3]]  # a pass's first row shares with nothing


def test_rows_in_order_are_dealt_to_ranks_in_runs_of_like_cost():
    rows = torch.arange(10, 20)
    costs = torch.tensor([30, 5, 5, 5, 30, 5, 5, 5, 10, 10])  # two prompts of 4 rows, then two rows alone
    shares = [deal_in_order(rows, costs, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat(shares), rows)  # in order, every row once
    # a row goes where the middle of its cost falls: the cut at 55 of 110 tokens falls between the prompts
    assert shares[0].tolist() == [10, 11, 12, 13] and shares[1].tolist() == [14, 15, 16, 17, 18, 19]
    assert [int(costs[share - 10].sum()) for share in shares] == [45, 65]
    three = [deal_in_order(rows, costs, rank, 3).tolist() for rank in range(3)]
    assert three == [[10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]  # cuts among a prompt's rows where they must
    assert deal_in_order(rows, costs, 0, 1).tolist() == rows.tolist()
