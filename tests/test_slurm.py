"""`areal-flow slurm`: the sbatch script's content, its shell syntax, and what it does when run
against stand-ins for srun, scontrol, curl, python and torchrun (the GPU layout, which no real
SLURM here can run; test_slurm_real.py submits the CPU layout to a real one)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import attrs
import pytest

from areal_flow.cli import main
from areal_flow.launch.slurm import RENDEZVOUS_PORT, SlurmJob, sbatch_script

JOB = SlurmJob(model="/shared/models/qwen", nodes=2, server_nodes=1, servers_per_node=2,
               recipe_args=("--steps", "200", "--run-dir", "runs/a run"))


def server_lines(script: str) -> list[list[str]]:
    return [shlex.split(line) for line in script.splitlines()
            if line.strip().startswith("start_server \"$node\"")]


def test_script_content():
    script = sbatch_script(JOB)
    assert f"#SBATCH --nodes={JOB.nodes + JOB.server_nodes}" in script
    assert f"#SBATCH --gpus-per-node={JOB.gpus_per_node}" in script
    assert "UNTESTED" in script
    assert "--partition" not in script
    servers = server_lines(script)
    assert len(servers) == JOB.servers_per_node
    tp = JOB.gpus_per_node // JOB.servers_per_node
    for index, argv in enumerate(servers):
        port = JOB.port_base + index
        gpus = ",".join(str(g) for g in range(index * tp, (index + 1) * tp))
        assert argv[2:4] == [str(port), gpus]
        command = argv[4:]
        assert command[:3] == ["python", "-m", "sglang.launch_server"]
        flags = dict(zip(command[3::2], command[4::2]))
        assert flags["--tp-size"] == str(tp)
        assert flags["--port"] == str(port)
        assert flags["--model-path"] == JOB.model
    torchrun = script[script.index("torchrun"):]
    assert f"--nnodes \"$TRAIN_NODES\" --nproc-per-node {JOB.gpus_per_node}" in torchrun
    assert f"TRAIN_NODES={JOB.nodes}" in script
    assert "--inference.addresses-file \"$ADDRESSES\"" in torchrun
    assert torchrun.rstrip().endswith(shlex.join(JOB.recipe_args))


def test_cpu_nodes_run_areal_flow_serve_and_one_rank_per_node():
    job = attrs.evolve(JOB, gpus_per_node=0, server_program="areal-flow")
    script = sbatch_script(job)
    assert "#SBATCH --gpus-per-node" not in script  # no GPU request: CPU nodes qualify
    assert "UNTESTED" not in script.splitlines()[1]  # tests/test_slurm_real.py runs this layout
    servers = server_lines(script)
    assert len(servers) == job.servers_per_node
    for index, argv in enumerate(servers):
        port = job.port_base + index
        assert argv[2:4] == [str(port), ""]  # CUDA_VISIBLE_DEVICES="": no GPU visible
        command = argv[4:]
        assert command[:2] == ["areal-flow", "serve"]
        flags = dict(zip(command[2::2], command[3::2]))
        assert (flags["--model"], flags["--port"], flags["--device"]) == (job.model, str(port),
                                                                          "cpu")
    torchrun = script[script.index("torchrun"):]
    assert "--nnodes \"$TRAIN_NODES\" --nproc-per-node 1 " in torchrun


def test_areal_flow_serve_on_gpu_nodes_gets_its_gpus():
    job = attrs.evolve(JOB, server_program="areal-flow", rendezvous_port=29600)
    script = sbatch_script(job)
    assert f"#SBATCH --gpus-per-node={job.gpus_per_node}" in script
    first = server_lines(script)[0]
    assert first[3] == "0,1,2,3" and first[4:6] == ["areal-flow", "serve"]
    assert "--device" not in first  # auto: the GPUs CUDA_VISIBLE_DEVICES shows
    assert '--rdzv-endpoint "$HEAD:29600"' in script


def test_partition_line():
    script = sbatch_script(attrs.evolve(JOB, partition="gpu-long"))
    assert "#SBATCH --partition=gpu-long" in script


def test_script_passes_bash_syntax_check(tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(sbatch_script(JOB))
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize(("field", "value"), [
    ("nodes", 0), ("server_nodes", 0), ("gpus_per_node", 0), ("servers_per_node", 3),
    ("port_base", 80), ("job_name", "two words"), ("time", ""), ("model", ""),
    ("gpus_per_node", -1), ("rendezvous_port", 70000),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"'{field}'"):
        sbatch_script(attrs.evolve(JOB, **{field: value}))


def test_cli_writes_the_script(tmp_path, capsys):
    out = tmp_path / "job.sh"
    args = ["slurm", "--model", JOB.model, "--nodes", str(JOB.nodes), "--server-nodes",
            str(JOB.server_nodes), "--servers-per-node", str(JOB.servers_per_node),
            "--out", str(out), "--", *JOB.recipe_args]
    assert main(args) == 0
    assert out.read_text() == sbatch_script(JOB)
    assert str(out) in capsys.readouterr().out


def test_cli_takes_the_layout_from_an_allocation(tmp_path, capsys):
    """--allocation (the recipes' form) writes the script the separate options write, and
    refuses them beside it."""
    by_options, by_allocation = tmp_path / "options.sh", tmp_path / "allocation.sh"
    assert main(["slurm", "--model", "m", "--nodes", "2", "--server-nodes", "1",
                 "--gpus-per-node", "8", "--servers-per-node", "4", "--out",
                 str(by_options)]) == 0
    allocation = "generation: 4 servers x tp 2, training: 16 ranks on 3 nodes x 8 gpus"
    assert main(["slurm", "--model", "m", "--allocation", allocation, "--out",
                 str(by_allocation)]) == 0
    assert by_allocation.read_text() == by_options.read_text()
    capsys.readouterr()
    assert main(["slurm", "--model", "m", "--allocation", allocation, "--nodes", "3"]) == 2
    assert f"--allocation '{allocation}' already says --nodes" in capsys.readouterr().err


def test_cli_names_a_bad_field(capsys):
    assert main(["slurm", "--model", "m", "--servers-per-node", "3"]) != 0
    assert "servers_per_node" in capsys.readouterr().err


# Stand-ins: srun runs its command here (SRUN_NODES says where it was sent), a "server" records
# itself and waits to be stopped, curl answers once that server has started, sleep returns, and
# torchrun records its arguments and returns once every server is in the addresses file (the
# servers join while "training" runs).
FAKES = {
    "scontrol": 'printf "%s\\n" $FAKE_NODES',
    "srun": 'while [[ $1 == -* ]]; do [[ $1 == -w ]] && { export SRUN_NODES=$2; shift; }; shift; '
            'done; exec "$@"',
    "python": 'port=$(printf "%s\\n" "$@" | grep -A1 -x -- --port | tail -n1); '
              'printf "%s\\n" "$SRUN_NODES" "$CUDA_VISIBLE_DEVICES" "$$" "$@" '
              '> "$STATE/server-$SRUN_NODES-$port"; exec tail -f /dev/null',
    "curl": 'address=${@: -1}; address=${address#http://}; address=${address%/health}; '
            '[ -e "$STATE/server-${address%:*}-${address#*:}" ]',
    "sleep": "exit 0",
    "torchrun": 'printf "%s\\n" "$SRUN_NODES" "$@" > "$STATE/torchrun"; '
                'file=$(printf "%s\\n" "$@" | grep -A1 -x -- --inference.addresses-file '
                '| tail -n1); '
                'until [ "$(grep -cv "^#" "$file")" -ge "$SERVERS" ]; do :; done',
}


def test_script_runs_servers_then_training_and_stops_the_servers(tmp_path):
    job = attrs.evolve(JOB, server_nodes=2)
    nodes = [f"node{i}" for i in range(job.server_nodes + job.nodes)]
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(sbatch_script(job))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(state),
           "FAKE_NODES": " ".join(nodes), "SLURM_JOB_NODELIST": f"node[0-{len(nodes) - 1}]",
           "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "42",
           "SERVERS": str(job.server_nodes * job.servers_per_node)}
    try:
        subprocess.run(["bash", str(script)], env=env, check=True, timeout=60)
        check_fake_run(job, nodes, tmp_path, state)
    except BaseException:  # a broken script must not leave stand-in servers behind
        for record in state.glob("server-*"):
            try:
                os.kill(int(record.read_text().split("\n")[2]), 9)
            except ProcessLookupError:
                pass
        raise


def check_fake_run(job: SlurmJob, nodes: list[str], tmp_path: Path, state: Path) -> None:
    servers, trainers = nodes[:job.server_nodes], nodes[job.server_nodes:]
    ports = [job.port_base + i for i in range(job.servers_per_node)]
    addresses = (tmp_path / "slurm-42" / "addresses.txt").read_text().splitlines()
    assert sorted(a for a in addresses if not a.startswith("#")) == \
        sorted(f"{n}:{p}" for n in servers for p in ports)
    tp = job.gpus_per_node // job.servers_per_node
    for node in servers:
        for index, port in enumerate(ports):
            record = (state / f"server-{node}-{port}").read_text().split("\n")
            node_seen, gpus, pid, *argv = record
            assert node_seen == node
            assert gpus == ",".join(map(str, range(index * tp, (index + 1) * tp)))
            assert argv[:2] == ["-m", "sglang.launch_server"]
            with pytest.raises(ProcessLookupError):  # stopped when training exited
                os.kill(int(pid), 0)
    srun_nodes, *torchrun = (state / "torchrun").read_text().splitlines()
    assert srun_nodes == ",".join(trainers)
    flags = dict(zip(torchrun, torchrun[1:]))
    assert flags["--nnodes"] == str(job.nodes)
    assert flags["--rdzv-endpoint"] == f"{trainers[0]}:{RENDEZVOUS_PORT}"
    assert flags["--inference.addresses-file"] == str(tmp_path / "slurm-42" / "addresses.txt")
    assert flags["--model"] == job.model
    assert torchrun[-len(job.recipe_args):] == list(job.recipe_args)
