"""Splitting a batch: whole groups to ranks and mini-batches, rows into micro-batches under a
token budget (rows are packed without padding: a micro-batch costs its rows' summed lengths)."""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence

import torch


def assign_groups(group_tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Per rank, its groups' indices (ascending; maybe none): largest group first to the
    least-loaded rank by tokens."""
    heap = [(0, rank) for rank in range(world_size)]
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for g in sorted(range(len(group_tokens)), key=lambda i: (-group_tokens[i], i)):
        load, rank = heapq.heappop(heap)
        owned[rank].append(g)
        heapq.heappush(heap, (load + group_tokens[g], rank))
    return [sorted(groups) for groups in owned]


def groups_to_ranks(group_ids: Sequence[int], lengths: Sequence[int],
                    world_size: int) -> list[list[int]]:
    """Per rank, the rows it trains: whole groups (`assign_groups`), in batch order."""
    groups: dict[int, list[int]] = defaultdict(list)
    for row, gid in enumerate(group_ids):
        groups[gid].append(row)
    members = list(groups.values())
    tokens = [sum(lengths[r] for r in rows) for rows in members]
    return [[r for g in owned for r in members[g]] for owned in assign_groups(tokens, world_size)]


def minibatch_of_rows(group_ids: torch.Tensor, parts: int) -> torch.Tensor:
    """Each row's mini-batch: whole groups dealt round-robin in order of first appearance,
    decided on the full batch so that the split does not depend on the world size."""
    order = {gid: k for k, gid in enumerate(dict.fromkeys(group_ids.tolist()))}
    return torch.tensor([order[g] % parts for g in group_ids.tolist()], dtype=torch.long)


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows into micro-batches of at most `max_tokens` tokens, first-fit decreasing; a row over
    the budget gets one of its own."""
    if max_tokens < 1:
        raise ValueError(f"'max_tokens_per_mb' must be >= 1: {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        fits = next((b for b, free in enumerate(room) if lengths[row] <= free), len(bins))
        if fits == len(bins):  # a new micro-batch
            bins.append([])
            room.append(max_tokens)
        bins[fits].append(row)
        room[fits] -= lengths[row]
    return bins


def split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Split the costliest micro-batches until there are `count` (FSDP needs as many passes on
    every rank); one-row bins stay whole, so the caller may still need to pad with empty ones."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        largest = max(splittable, key=lambda b: sum(lengths[r] for r in b))
        bins.remove(largest)
        half = len(largest) // 2
        bins += [largest[:half], largest[half:]]
    return bins
