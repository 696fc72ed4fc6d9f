"""Splitting a batch, case by case: which rank, mini-batch and micro-batch each row lands in
(the property tests in test_runtime.py check what holds for any input)."""

from __future__ import annotations

import pytest
import torch

from areal_flow.runtime.microbatch import (
    assign_groups,
    groups_to_ranks,
    micro_batches,
    minibatch_of_rows,
    split_to_count,
)


def test_groups_go_largest_first_to_the_least_loaded_rank():
    # 9 and 9 open the two ranks; 5 joins the first (a tie goes to the lower rank), 1 the other
    assert assign_groups([5, 9, 9, 1], 2) == [[0, 1], [2, 3]]
    assert assign_groups([4, 4, 4], 2) == [[0, 2], [1]]  # equal groups: in order
    assert assign_groups([3], 3) == [[0], [], []]  # fewer groups than ranks
    assert assign_groups([], 2) == [[], []]


def test_rows_go_to_ranks_group_by_group_in_batch_order():
    # groups 7 (rows 0-1, 2 tokens), 3 (rows 2-3, 20 tokens), 5 (row 4, 4 tokens)
    assert groups_to_ranks([7, 7, 3, 3, 5], [1, 1, 10, 10, 4], 2) == [[2, 3], [0, 1, 4]]
    assert groups_to_ranks([0, 0, 1, 1], [3, 3, 3, 3], 1) == [[0, 1, 2, 3]]


def test_mini_batches_deal_whole_groups_round_robin_by_first_appearance():
    ids = torch.tensor([4, 4, 9, 9, 2, 2, 6])
    assert minibatch_of_rows(ids, 2).tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert minibatch_of_rows(ids, 3).tolist() == [0, 0, 1, 1, 2, 2, 0]
    assert minibatch_of_rows(ids, 1).tolist() == [0] * 7
    # an index tensor even when empty (a rank with no rows): torch.tensor([]) alone is float
    assert minibatch_of_rows(torch.tensor([], dtype=torch.long), 2).dtype == torch.long


def test_micro_batches_are_first_fit_longest_first_and_a_row_may_fill_one_exactly():
    # 8 opens one, 5 another (8 + 5 > 10), 3 joins the 5, each 2 fills a micro-batch to 10
    assert micro_batches([5, 3, 8, 2, 2], 10) == [[2, 3], [0, 1, 4]]
    assert micro_batches([10, 10], 10) == [[0], [1]]
    assert micro_batches([4, 4], 8) == [[0, 1]]  # exactly the budget fits
    assert micro_batches([12, 1], 10) == [[0], [1]]  # a row over the budget: one of its own
    assert micro_batches([1], 1) == [[0]]  # the smallest budget
    assert micro_batches([], 5) == []
    with pytest.raises(ValueError, match="'max_tokens_per_mb' must be >= 1"):
        micro_batches([1], 0)


def test_splitting_halves_the_costliest_splittable_micro_batch_first():
    lengths = [5, 5, 1, 1, 1]
    bins = [[0, 1], [2, 3, 4]]
    assert split_to_count(bins, lengths, 3) == [[2, 3, 4], [0], [1]]
    assert bins == [[0, 1], [2, 3, 4]]  # the caller's list is left alone
    # the single row costs most but cannot be split: the other one is, in halves
    assert split_to_count([[0, 1, 2, 3], [4]], [1, 1, 1, 1, 10], 3) == [[4], [0, 1], [2, 3]]
    assert split_to_count([[0, 1, 2], [3]], [1, 1, 1, 1], 3) == [[3], [0], [1, 2]]
    assert split_to_count([[0], [1]], [1, 1], 4) == [[0], [1]]  # nothing left to split
    assert split_to_count([[0, 1]], [1, 1], 1) == [[0, 1]]
