"""Servers joining and leaving a live run: the recipe trains from servers listed in an addresses
file; a server is added mid-run, then another is SIGKILLed. The run finishes, every group is
trained exactly once, the newcomer gets the current weights before its first request, and the
metrics show the membership changes."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from areal_flow.inference.launcher import SGLangLauncher, serve_command
from tests.helpers import ROOT, metrics
from tests.test_sglang_pool import write_addresses

STEPS, GROUPS = 16, 2


def logged(run_dir: Path) -> list[dict]:
    """metrics.jsonl while the run writes it (a line being written reads as not there yet)."""
    if not (run_dir / "metrics.jsonl").exists():
        return []
    try:
        return metrics(run_dir)
    except ValueError:
        return []


def weight_version(address: str) -> str:
    return str(httpx.get(f"http://{address}/model_info", timeout=5).json()["weight_version"])


def logged_steps(run_dir: Path) -> int:
    return max((m["step"] for m in logged(run_dir)), default=0)


@pytest.mark.faults
def test_a_server_joins_and_another_dies_mid_run_and_no_group_is_lost(tiny_model_dir, tmp_path):
    listing, run_dir = tmp_path / "servers.txt", tmp_path / "run"
    data = tmp_path / "rows.jsonl"  # more rows than the run trains on: no group comes twice
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?",
                                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                            for a in range(8) for b in range(6)))
    # training is held (a reward waits while `gate` exists) whenever the run must not move on:
    # while the newcomer joins, and while b is killed, so b dies with steps left to notice it
    gate = tmp_path / "gate"
    # servers start from the initial weights, labelled version 0 (a newcomer served before it
    # caught up would hand out version-0 tokens late in the run)
    with SGLangLauncher(tiny_model_dir, gpus=[0, 1, 2], log_dir=str(tmp_path / "servers"),
                        command=functools.partial(serve_command, dtype="float32")) as servers:
        a, b, c = servers.addresses
        write_addresses(listing, a, b)
        run = subprocess.Popen(
            [sys.executable, str(ROOT / "recipes" / "gsm8k_grpo.py"), "--model",
             str(tiny_model_dir), "--dataset", str(data), "--run-dir", str(run_dir),
             "--steps", str(STEPS), "--eval-size", "4", "--rollout.batch-size", str(GROUPS),
             "--rollout.group-size", "2", "--sampling.max-new-tokens", "32",
             "--rollout.max-staleness", "1", "--reward", "tests.rewards_for_tests:gated_length",
             "--inference.dtype", "float32", "--train.dtype", "float32",
             "--inference.backend", "sglang", "--inference.addresses-file", str(listing),
             "--inference.lease-dir", str(tmp_path / "leases")],
            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                           "AREAL_TEST_GATE": str(gate)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300

            def wait_for(ready) -> None:
                while not ready():
                    assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()
                    time.sleep(0.1)  # polling a file the run writes, or a server

            wait_for(lambda: logged_steps(run_dir) >= 1)
            gate.touch()
            write_addresses(listing, a, b, c)
            # the newcomer is caught up when it reports the weights the others have
            wait_for(lambda: weight_version(c) == weight_version(a) != "0")
            gate.unlink()
            wait_for(lambda: any(m.get("pool/servers_healthy") == 3 for m in logged(run_dir)))
            gate.touch()  # at most the groups already rewarded train before b is gone
            servers.processes[1].send_signal(signal.SIGKILL)
            servers.processes[1].wait()
            assert logged_steps(run_dir) <= STEPS // 2, "the gate did not hold the run"
            gate.unlink()
            output, _ = run.communicate(timeout=300)
        finally:
            gate.unlink(missing_ok=True)
            if run.poll() is None:
                run.kill()
                run.wait()
        assert run.returncode == 0, output
        assert servers.processes[1].poll() == -signal.SIGKILL

    steps = [m for m in metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    # every step trained GROUPS groups, and no group twice: none lost, none duplicated
    groups = [i for m in steps for i in m["sample_ids"]]
    assert all(len(m["sample_ids"]) == GROUPS for m in steps)
    assert len(set(groups)) == len(groups) == STEPS * GROUPS
    # rollouts go on while the trainer trains (max-staleness 1), so the newcomer gets requests
    # as soon as it is in rotation; no trained token is older than that bound: the newcomer
    # (started at version 0) served nothing before it had the current weights
    assert max(m["staleness/max"] for m in steps) <= 1
    assert sum(m["pool/behind_replies"] for m in steps) == 0
    # the membership changes, as the panel's pool/* columns show them
    joined = [m["pool/servers_joined"] for m in steps]
    assert joined[0] == 2 and sum(joined[1:]) == 1  # the file's two at start, then the newcomer
    assert sum(m["pool/dead_servers"] for m in steps) >= 1
    healthy = [m["pool/servers_healthy"] for m in steps]
    assert 3 in healthy and healthy[-1] == 2
