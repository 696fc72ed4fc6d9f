"""`areal-flow slurm` jobs under a real SLURM: the script the CLI writes is submitted with sbatch
and runs a short GRPO run on the tiny model; `scancel` mid-run leaves a checkpoint that a second
job resumes from.

Needs a SLURM cluster with two idle nodes, three for the two-training-node test (skipped
otherwise, with the reason; CI requires the cluster): `bash scripts/slurm_local.sh start` (root,
apt) makes one on this machine (Debian's slurm-wlm;
three `slurmd -N` emulate three nodes). CPU only: the servers are `areal-flow serve`
(`--server-program areal-flow --gpus-per-node 0`); GPUs and SGLang itself stay covered by the
stand-ins of test_slurm.py only.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, metrics

JOB_SECONDS = 120
"""Bound on one job, queueing included (a run takes ~15 s here)."""
POLL = 0.5


def _idle_nodes() -> set[str]:
    lines = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                           timeout=20).stdout.split("\n")
    return {line.split()[0] for line in lines if line.endswith(" idle")}


def _slurm_missing() -> str | None:
    """Why these tests cannot run here, or None."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (a local cluster: bash scripts/slurm_local.sh start)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`scontrol ping` failed: {exc}"
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return ("no SLURM controller answers `scontrol ping` (a local cluster: bash "
                f"scripts/slurm_local.sh start): {(ping.stdout + ping.stderr).strip()[:80]}")
    if len(idle := _idle_nodes()) < 2:
        return f"needs 2 idle SLURM nodes (a server node and a training node); idle: {idle}"
    return None


MISSING = _slurm_missing()
REQUIRED = os.environ.get("AREAL_FLOW_REQUIRE_SLURM") == "1"
"""Set by `.ci/run`, which starts the local cluster first: there a missing cluster fails these
tests instead of skipping them (the README's test command, run anywhere else, skips them)."""
pytestmark = pytest.mark.skipif(MISSING is not None and not REQUIRED, reason=MISSING or "")


@pytest.fixture(autouse=True)
def _cluster_when_required():
    if MISSING is not None:  # reached only with AREAL_FLOW_REQUIRE_SLURM=1
        pytest.fail(f"AREAL_FLOW_REQUIRE_SLURM=1, but {MISSING}")

CLI = Path(sys.executable).with_name("areal-flow")
"""The console script the job's servers run too (`areal-flow serve`, found on the job's PATH)."""
ENV = {**os.environ, "PATH": f"{CLI.parent}{os.pathsep}{os.environ['PATH']}",
       "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
"""What sbatch hands on to the job (its default --export=ALL): this venv first on PATH."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def write_job(folder: Path, model: Path, data: Path, run_dir: Path, *recipe_args: str,
              nodes: int = 1) -> Path:
    """The job script, written by the real CLI: one areal-flow serve node, `nodes` training
    nodes (said with --allocation when there are two, with the separate options otherwise)."""
    folder.mkdir(exist_ok=True)
    script = folder / "job.sh"
    layout = ["--allocation", f"generation: 1 server, training: {nodes} ranks on "
                              f"{nodes + 1} cpu nodes"] if nodes > 1 else [
        "--nodes", str(nodes), "--server-nodes", "1", "--gpus-per-node", "0",
        "--server-program", "areal-flow"]
    subprocess.run(
        [str(CLI), "slurm", "--model", str(model), *layout,
         "--recipe", str(ROOT / "recipes" / "gsm8k_grpo.py"), "--job-name", "af-test",
         "--time", "10:00", "--port-base", str(free_port()), "--rendezvous-port",
         str(free_port()), "--out", str(script), "--",
         "--dataset", str(data), "--run-dir", str(run_dir), "--eval-size", "4",
         "--save-every", "1", "--rollout.batch-size", "2", "--rollout.group-size", "2",
         "--sampling.max-new-tokens", "8", "--inference.dtype", "float32", "--train.dtype", "float32",
         *recipe_args],
        check=True, env=ENV, capture_output=True, text=True, timeout=120)
    return script


class Job:
    """One submitted job (cancelled by `close` if it is still queued or running)."""

    def __init__(self, script: Path):
        self.folder = script.parent
        submitted = subprocess.run(["sbatch", "--parsable", script.name], cwd=self.folder,
                                   env=ENV, capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        self.id = submitted.stdout.strip().split(";")[0]
        self.began = time.monotonic()

    @property
    def output(self) -> str:
        path = self.folder / f"af-test-{self.id}.out"
        return path.read_text() if path.exists() else "(no output file yet)"

    @property
    def job_dir(self) -> Path:
        return self.folder / f"slurm-{self.id}"

    def queued(self) -> bool:
        state = subprocess.run(["squeue", "-h", "-j", self.id, "-o", "%T"], capture_output=True,
                               text=True, timeout=30)
        return bool(state.stdout.strip())

    def wait_until(self, condition, what: str) -> None:
        """Poll `condition` (files the job writes, the queue) until it holds, within the bound."""
        while not condition():
            assert time.monotonic() - self.began < JOB_SECONDS, \
                f"job {self.id}: no {what} after {JOB_SECONDS} s\n{self.output[-4000:]}"
            time.sleep(POLL)  # polling another process's progress, with a deadline

    def finish(self) -> dict[str, str]:
        """Wait until the job leaves the queue; its final record (scontrol show job)."""
        self.wait_until(lambda: not self.queued(), "end")
        shown = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True,
                               text=True, timeout=30).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def close(self) -> None:
        if self.queued():
            subprocess.run(["scancel", self.id], timeout=30)
            deadline = time.monotonic() + 60
            while self.queued() and time.monotonic() < deadline:
                time.sleep(POLL)


@pytest.fixture
def submit():
    jobs: list[Job] = []

    def submit(script: Path) -> Job:
        jobs.append(Job(script))
        return jobs[-1]

    yield submit
    for job in jobs:  # a failed check must not leave a job running
        job.close()


def server_ports(script: Path) -> list[int]:
    return [int(line.split()[2]) for line in script.read_text().splitlines()
            if line.strip().startswith('start_server "$node"')]


def check_layout(job: Job, script: Path, run_dir: Path, nodes: int = 1) -> None:
    """One `areal-flow serve` on the first node; its address reached the trainer (on the other
    `nodes` nodes) through the addresses file only; the servers are gone once the job is."""
    servers = [line.split()[4:6] for line in script.read_text().splitlines()
               if line.strip().startswith('start_server "$node"')]
    assert servers == [["areal-flow", "serve"]]
    (port,) = server_ports(script)
    layout = re.search(r"server nodes: (.+?); training nodes: (.+?);", job.output)
    assert layout, job.output[-4000:]
    server_nodes, train_nodes = (part.split() for part in layout.groups())
    assert len(server_nodes) == 1 and len(train_nodes) == nodes
    (server_node,) = server_nodes
    assert server_node not in train_nodes
    assert f"{nodes} training rank(s)" in job.output  # one torchrun rank per CPU node
    addresses = (job.job_dir / "addresses.txt").read_text().splitlines()
    assert [a for a in addresses if not a.startswith("#")] == [f"{server_node}:{port}"]
    assert (job.job_dir / "logs" / f"server-{server_node}-{port}.log").stat().st_size > 0
    config = (run_dir / "config.yaml").read_text()
    assert f"addresses_file: {job.job_dir / 'addresses.txt'}" in config
    assert re.search(r"\baddresses: \[\]", config), config  # the file was the only source
    lines = [m for m in metrics(run_dir) if m["step"] > 0]
    assert lines and all(m["pool/servers"] == 1 for m in lines)
    assert sum(m["pool/requests"] for m in lines) > 0
    assert not listening(port)


def test_a_job_serves_and_trains_end_to_end(tiny_model_dir, gsm8k_file, tmp_path, submit):
    run_dir = tmp_path / "run"
    script = write_job(tmp_path, tiny_model_dir, gsm8k_file, run_dir, "--steps", "2")
    job = submit(script)
    record = job.finish()
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), job.output[-4000:]
    assert f"done: {run_dir}" in job.output
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2]
    assert (run_dir / "checkpoints" / "step-000002" / "COMPLETE").exists()
    assert (run_dir / "checkpoints" / "step-000002" / "hf" / "config.json").exists()
    check_layout(job, script, run_dir)


def complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in run_dir.glob("checkpoints/step-*/COMPLETE"))


@pytest.mark.faults
def test_scancel_mid_run_leaves_a_checkpoint_that_a_job_resumes(tiny_model_dir, gsm8k_file,
                                                                  tmp_path, submit):
    """scancel SIGTERMs every process of the job's steps, and torchrun relays the one it gets,
    so the recipe gets two at once: one graceful stop (StopRequest reads a repeat within a
    second as the same request, not "stop now"); the last complete checkpoint is left, the
    servers are gone, and a second job resumes from that checkpoint."""
    run_dir = tmp_path / "run"
    first = write_job(tmp_path / "first", tiny_model_dir, gsm8k_file, run_dir, "--steps", "1000")
    job = submit(first)
    # any: steps take ~0.05 s and only the last two checkpoints are kept
    job.wait_until(lambda: complete_steps(run_dir) or not job.queued(), "first checkpoint")
    subprocess.run(["scancel", job.id], check=True, timeout=30)
    record = job.finish()
    assert record["JobState"] == "CANCELLED", (record, job.output[-4000:])
    assert "SIGTERM: stopping after this step" in job.output
    assert "KeyboardInterrupt" not in job.output, job.output[-4000:]
    last = complete_steps(run_dir)[-1]
    assert 1 <= last < 1000
    (port,) = server_ports(first)
    assert not listening(port)  # the job's server went with it

    total = last + 2
    second = write_job(tmp_path / "second", tiny_model_dir, gsm8k_file, run_dir, "--steps",
                       str(total), "--resume")
    resumed = submit(second)
    record = resumed.finish()
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), \
        resumed.output[-4000:]
    assert f"step {last + 1}/{total}" in resumed.output  # from the checkpoint, not step 1
    assert not any(f"step {step}/{total}" in resumed.output for step in range(1, last + 1))
    assert [m["step"] for m in metrics(run_dir)] == list(range(total + 1))
    assert complete_steps(run_dir)[-1] == total
    check_layout(resumed, second, run_dir)


@pytest.mark.skipif(MISSING is None and len(_idle_nodes()) < 3,
                    reason="needs 3 idle SLURM nodes (scripts/slurm_local.sh starts 3)")
def test_two_training_nodes_rendezvous_across_nodes(tiny_model_dir, gsm8k_file, tmp_path, submit):
    """torchrun on two nodes (c10d rendezvous on the first training node), one rank each: the
    run trains with a world of 2."""
    run_dir = tmp_path / "run"
    script = write_job(tmp_path, tiny_model_dir, gsm8k_file, run_dir, "--steps", "2", nodes=2)
    job = submit(script)
    record = job.finish()
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), job.output[-4000:]
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2]
    assert (run_dir / "checkpoints" / "step-000002" / "COMPLETE").exists()
    check_layout(job, script, run_dir, nodes=2)
