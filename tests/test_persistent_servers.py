"""Servers that outlive runs: a run attaching with --inference.addresses replaces whatever
weights the servers hold with its own, and two runs never write weights into one server at once
(leases, `areal_flow/launch/lease.py`)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from areal_flow.launch import lease as lease_module
from areal_flow.inference.launcher import SGLangLauncher, serve_command
from areal_flow.launch.lease import Leases, ServerLeased
from tests.helpers import ROOT, metrics, run_recipe
from tests.test_local_engine import save_perturbed

RECIPE = "gsm8k_grpo.py"


# -- leases --------------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """The leases' wall clock, moved by the test."""
    now = [1_000.0]
    monkeypatch.setattr(lease_module.time, "time", lambda: now[0])
    return now


def test_a_held_lease_refuses_another_run_naming_the_holder(tmp_path, clock):
    first = Leases(tmp_path, holder="run A (pid 1 on n1)", ttl=60)
    second = Leases(tmp_path, holder="run B (pid 2 on n2)", ttl=60)
    first.acquire("n3:30000")
    first.acquire("n3:30000")  # again: still ours
    with pytest.raises(ServerLeased, match=r"n3:30000 is leased by run A \(pid 1 on n1\)"):
        second.acquire("n3:30000")
    second.acquire("n3:30001")  # another server is free
    first.release()
    second.acquire("n3:30000")  # given back: free
    assert second.held == {"n3:30000", "n3:30001"}


@pytest.mark.faults
def test_an_expired_lease_is_taken_over_and_its_old_holder_learns_it_on_renewal(tmp_path,
                                                                                 clock):
    first = Leases(tmp_path, holder="A", ttl=60)
    second = Leases(tmp_path, holder="B", ttl=60)
    first.acquire("h:1")
    clock[0] += 59
    with pytest.raises(ServerLeased):
        second.acquire("h:1")
    assert first.renew() == []  # renewed in time: another 60 s
    clock[0] += 59
    with pytest.raises(ServerLeased):
        second.acquire("h:1")
    clock[0] += 2  # A missed its renewal (suspended, dead): the lease is free
    second.acquire("h:1")
    assert first.renew() == ["h:1"] and first.held == set()
    first.release()  # never removes a lease it no longer holds
    with pytest.raises(ServerLeased, match="leased by B"):
        Leases(tmp_path, holder="C").acquire("h:1")


def test_runs_taking_an_expired_lease_together_never_both_hold_it(tmp_path, clock,
                                                                  monkeypatch):
    """Eight runs see the same expired lease at once; exactly one gets it. (Each read is held
    open a moment so that, without the lock, they all would decide it is free.)"""
    import threading

    Leases(tmp_path, holder="dead", ttl=1).acquire("h:1")
    clock[0] += 5
    read = Leases._read

    def slow_read(path):
        found = read(path)
        time.sleep(0.02)  # widens the window between the check and the write; orders nothing
        return found

    monkeypatch.setattr(Leases, "_read", staticmethod(slow_read))
    runs = [Leases(tmp_path, holder=f"run {i}") for i in range(8)]
    start = threading.Barrier(len(runs))
    outcomes: list[str] = []

    def take(run: Leases) -> None:
        start.wait()
        try:
            run.acquire("h:1")
            outcomes.append("took")
        except ServerLeased:
            outcomes.append("refused")

    threads = [threading.Thread(target=take, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["refused"] * 7 + ["took"]
    assert sum(len(run.held) for run in runs) == 1


# -- a run attaching to servers that outlive it ----------------------------------------------


@pytest.fixture(scope="module")
def other_weights(tiny_model_dir, tmp_path_factory) -> Path:
    """Weights of another run: the tiny model perturbed."""
    path = save_perturbed(tiny_model_dir, tmp_path_factory.mktemp("other_weights"), 0.2, seed=5)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)  # a run needs one
    return path


def greedy_args(model, data, run_dir, lease_dir, *extra):
    """One step whose rollouts are greedy: what generated them is read off the completions."""
    return ["--model", str(model), "--dataset", str(data), "--run-dir", str(run_dir),
            "--steps", "1", "--eval-size", "4", "--rollout.batch-size", "2",
            "--rollout.group-size", "2", "--sampling.max-new-tokens", "8",
            "--sampling.temperature", "0", "--rollout.max-staleness", "0",
            "--inference.dtype", "float32", "--train.dtype", "float32",
            "--inference.lease-dir", str(lease_dir), *extra]


def completions(run_dir: Path) -> list[str]:
    return [json.loads(line)["completion"]
            for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.mark.faults
def test_a_run_attaching_to_a_server_replaces_its_weights_and_waits_its_turn(
        tiny_model_dir, gsm8k_file, other_weights, tmp_path):
    leases = tmp_path / "leases"
    # the reference: servers this run launches start from its model
    run_recipe(RECIPE, greedy_args(tiny_model_dir, gsm8k_file, tmp_path / "launched", leases,
                                   "--inference.backend", "sglang", "--inference.server-program",
                                   "areal-flow", "--inference.server-gpus", "0"))
    expected = completions(tmp_path / "launched")

    # a server that outlives runs, holding another run's weights
    with SGLangLauncher(other_weights, gpus=[0], log_dir=str(tmp_path / "servers"),
                        command=functools.partial(serve_command, dtype="float32")) as server:
        address = server.addresses[0]
        attached = ["--inference.backend", "sglang", "--inference.addresses", address]
        # a first run holds the server while it trains ...
        holder = subprocess.Popen(
            [sys.executable, str(ROOT / "recipes" / RECIPE), *greedy_args(
                other_weights, gsm8k_file, tmp_path / "first", leases, *attached),
             "--steps", "1000"],
            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 240
            while not (tmp_path / "first" / "metrics.jsonl").exists() or not any(
                    m["step"] >= 1 for m in metrics(tmp_path / "first")):
                assert holder.poll() is None and time.monotonic() < deadline, \
                    holder.stdout.read()
                time.sleep(0.2)  # polling a file the other process writes
            # ... so a second one is refused before it loads anything, naming the holder
            refused = run_recipe(RECIPE, greedy_args(tiny_model_dir, gsm8k_file,
                                                     tmp_path / "second", leases, *attached),
                                 check=False)
            assert refused.returncode != 0
            assert f"generation server {address} is leased by {tmp_path / 'first'}" in \
                refused.stderr + refused.stdout
        finally:
            holder.terminate()  # the first run stops (and gives its lease back)
            output, _ = holder.communicate(timeout=120)
        assert holder.returncode == 0, output
        assert not list(leases.glob("*.lease"))

        # now the second run attaches: its rollouts come from its own weights, not the ones
        # the server held
        run_recipe(RECIPE, greedy_args(tiny_model_dir, gsm8k_file, tmp_path / "second", leases,
                                       *attached))
        assert completions(tmp_path / "second") == expected
    stale = completions(tmp_path / "first")[:len(expected)]
    assert stale != expected  # the server's old weights would have given other completions


@pytest.mark.faults
def test_a_lease_of_a_process_gone_from_this_host_is_free_at_once(tmp_path, clock):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    Leases(tmp_path, holder="a run killed outright", ttl=600).acquire("h:1")
    lease_file = next(tmp_path.glob("*.lease"))
    record = json.loads(lease_file.read_text())
    with pytest.raises(ServerLeased):  # its process (this one) is alive
        Leases(tmp_path, holder="B").acquire("h:1")
    lease_file.write_text(json.dumps({**record, "pid": int(dead.stdout)}))  # now it is gone
    Leases(tmp_path, holder="B").acquire("h:1")
    elsewhere = {**record, "host": "another-node", "pid": int(dead.stdout)}
    lease_file.write_text(json.dumps(elsewhere))  # on another host: trusted until it expires
    with pytest.raises(ServerLeased, match="a run killed outright"):
        Leases(tmp_path, holder="C").acquire("h:1")
