"""The FSDP2 runtime: micro-batching properties, and 1 rank == 2 ranks == any micro-batch split."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from areal_flow.runtime.microbatch import assign_groups, micro_batches, split_to_count

SCRIPT = Path(__file__).with_name("dist_train_script.py")


@given(st.lists(st.integers(1, 300), max_size=40), st.integers(1, 1000))
def test_micro_batches_cover_every_row_once_within_the_budget(lengths, budget):
    bins = micro_batches(lengths, budget)
    assert sorted(r for b in bins for r in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) == 1 or sum(lengths[r] for r in b) <= budget


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 1000), st.data())
def test_splitting_to_a_count_keeps_rows_and_only_adds_bins(lengths, budget, data):
    bins = micro_batches(lengths, budget)
    count = data.draw(st.integers(1, len(bins) + len(lengths)))
    split = split_to_count(bins, lengths, count)
    assert sorted(r for b in split for r in b) == list(range(len(lengths)))
    # split until `count` is reached or every micro-batch is a single row; never merged
    assert len(split) == max(len(bins), min(count, len(lengths)))
    assert all(any(set(b) <= set(old) for old in bins) for b in split)


@given(st.lists(st.integers(1, 500), max_size=30), st.integers(1, 4))
def test_groups_go_whole_to_ranks_and_the_load_is_balanced(tokens, world):
    owned = assign_groups(tokens, world)
    assert sorted(g for rank in owned for g in rank) == list(range(len(tokens)))
    loads = [sum(tokens[g] for g in rank) for rank in owned]
    # greedy largest-first: no rank exceeds the mean by more than the largest group
    if tokens:
        assert max(loads) <= sum(tokens) / world + max(tokens)


def run_all(model_dir: Path, out: Path, runs: dict[str, tuple[int, str, int]]) -> dict:
    """Start every run at once (each a torchrun world of 1 or 2 ranks) and load the results."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {}
    for i, (name, (ranks, kind, mb_tokens)) in enumerate(runs.items()):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(29610 + i), str(SCRIPT), str(model_dir),
               str(out / f"{name}.pt"), kind, str(mb_tokens)]
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True)  # killed with its ranks
    results = {}
    try:
        for name, proc in procs.items():
            output, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{name} failed:\n{output[-3000:]}"
            results[name] = torch.load(out / f"{name}.pt")
    finally:  # one failed run must not leave the others running
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def equivalence_runs(tiny_model_dir, tmp_path_factory):
    big, small = 100_000, 120  # one micro-batch per rank, or many
    return run_all(tiny_model_dir, tmp_path_factory.mktemp("equivalence"), {
        "token_1rank": (1, "token", big), "token_2ranks": (2, "token", small),
        "sequence_1rank": (1, "sequence", big), "sequence_2ranks": (2, "sequence", small),
        "wrong_1rank": (1, "wrong", big), "wrong_2ranks": (2, "wrong", small),
        "minibatches_1rank": (1, "minibatches", big), "minibatches_2ranks": (2, "minibatches", small),
    })


GRAD_TOL, PARAM_TOL = 1e-6, 2e-4


@pytest.mark.parametrize("kind", ["token", "sequence", "minibatches"])
def test_one_rank_equals_two_ranks_with_other_micro_batches(equivalence_runs, kind):
    one, two = equivalence_runs[f"{kind}_1rank"], equivalence_runs[f"{kind}_2ranks"]
    assert max_diff(one["grads"], two["grads"]) < GRAD_TOL
    assert max_diff(one["params"], two["params"]) < PARAM_TOL
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)
    assert max(g.abs().max().item() for g in one["grads"].values()) > 100 * GRAD_TOL


def test_a_per_micro_batch_mean_loss_fails_the_same_check(equivalence_runs):
    one, two = equivalence_runs["wrong_1rank"], equivalence_runs["wrong_2ranks"]
    assert max_diff(one["grads"], two["grads"]) > 100 * GRAD_TOL


def test_parameters_moved_far_beyond_the_tolerance(equivalence_runs, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    end = equivalence_runs["token_1rank"]["params"]
    assert max((end[k] - start[k]).abs().max().item() for k in end) > 100 * PARAM_TOL


def test_a_failure_on_rank_zero_stops_every_rank(tiny_model_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", "29640", str(SCRIPT), str(tiny_model_dir), str(tmp_path / "x.pt"),
         "fail", "1000"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # both ranks report rank 0's error rather than one of them waiting for a batch forever
    assert (proc.stdout + proc.stderr).count("rank 0 failed before training") >= 2


def test_every_collective_gets_a_tensor_its_backend_serves_on_a_gpu_machine(tiny_model_dir,
                                                                           tmp_path):
    """Two ranks train (two mini-batches), sync weights, vote on a stop, checkpoint and reload,
    with every tensor collective checked against the backend a CUDA machine's group would get:
    an NCCL-only group would reject the CPU tensors (loss totals, flags, pickled objects)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "seen.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", "29650", str(SCRIPT), str(tiny_model_dir), str(out), "checked", "120"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        seen = torch.load(f"{out}.{rank}")
        assert seen["violations"] == [], seen["violations"][:5]
        # the check saw the CPU-side traffic (counts, totals, object collectives), not nothing
        assert seen["calls"].get("cpu", 0) >= 20, seen["calls"]
