"""--allocation (areal_flow/launch/allocation.py): the grammar both ways, every error naming its part
and suggesting an accepted allocation, the placement of every process, what it sets for the
launcher and the SLURM generator, and the RL recipe's --allocation / --dry-run end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow import config, rl_recipes
from areal_flow.launch.allocation import EXAMPLES, Allocation, AllocationError, launch_command
from areal_flow.launch.slurm import slurm_layout
from areal_flow.config import InferenceConfig
from tests.helpers import ROOT, metrics

ONE_NODE = "generation: 2 servers x tp 2, training: 4 ranks"
"""README: one node, 4 training ranks, SGLang servers on GPUs 4-7."""
SLURM = "generation: 4 servers x tp 2, training: 16 ranks on 3 nodes x 8 gpus"
"""README: 1 node of SGLang servers (4 x tp 2), 2 nodes of training."""


# -- strategies ------------------------------------------------------------------------------


@st.composite
def allocations(draw) -> Allocation:
    """Any valid allocation, built from its placement rules (so none is filtered away)."""
    form = draw(st.sampled_from(["gpu", "gpu nodes", "cpu", "cpu nodes"]))
    if form == "gpu":
        servers, tp, ranks = (draw(st.integers(1, n)) for n in (4, 4, 8))
        spare = draw(st.none() | st.integers(0, 3))
        return Allocation(servers=servers, tp=tp, ranks=ranks, gpus_per_node=None if spare is None
                          else ranks + servers * tp + spare)
    if form == "gpu nodes":
        gpus = draw(st.sampled_from([1, 2, 4, 6, 8]))
        tp = draw(st.sampled_from([d for d in range(1, gpus + 1) if gpus % d == 0]))
        per_node, server_nodes = gpus // tp, draw(st.integers(1, 3))
        servers = draw(st.integers((server_nodes - 1) * per_node + 1, server_nodes * per_node))
        training_nodes, per = draw(st.integers(1, 3)), draw(st.integers(1, gpus))
        return Allocation(servers=servers, tp=tp, ranks=training_nodes * per, gpus_per_node=gpus,
                          nodes=server_nodes + training_nodes)
    if form == "cpu":
        return Allocation(servers=draw(st.integers(1, 4)), ranks=draw(st.integers(1, 4)),
                          device="cpu")
    ranks, server_nodes = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return Allocation(servers=draw(st.integers(server_nodes, 3 * server_nodes)), ranks=ranks,
                      nodes=ranks + server_nodes, device="cpu")


def canonical(a: Allocation) -> str:
    """The canonical text, written here independently of `Allocation.__str__`."""
    s = lambda n: "" if n == 1 else "s"  # noqa: E731
    tp = f" x tp {a.tp}" if a.tp > 1 else ""
    if a.cpu:
        where = "cpu" if a.nodes == 1 else f"{a.nodes} cpu nodes"
    elif a.nodes == 1:
        where = f"{a.gpus_per_node} gpu{s(a.gpus_per_node)}"
    else:
        where = f"{a.nodes} nodes x {a.gpus_per_node} gpu{s(a.gpus_per_node)}"
    return (f"generation: {a.servers} server{s(a.servers)}{tp}, "
            f"training: {a.ranks} rank{s(a.ranks)} on {where}")


@st.composite
def spellings(draw, a: Allocation) -> str:
    """Another way to write `a`: case, spacing, singular/plural, part order, 'x' or '×',
    'x tp 1', '1 node x', and no 'on' where it is one node with exactly the GPUs used."""
    def word(w: str) -> str:
        return draw(st.sampled_from([w, w.upper(), w.capitalize()]))

    sp = lambda: draw(st.sampled_from([" ", "  ", "\t"]))  # noqa: E731
    x = lambda: draw(st.sampled_from(["x", "×", " x", "X"])) + sp()  # noqa: E731
    noun = lambda w: word(w + draw(st.sampled_from(["", "s"])))  # noqa: E731
    tp = f"{sp()}{x()}{word('tp')}{sp()}{a.tp}" if a.tp > 1 or draw(st.booleans()) else ""
    parts = [f"{word('generation')}:{sp()}{a.servers}{sp()}{noun('server')}{tp}",
             f"{word('training')} :{a.ranks}{sp()}{noun('rank')}"]
    text = f",{sp()}".join(draw(st.permutations(parts)))
    exact = not a.cpu and a.nodes == 1 and a.gpus_per_node == a.ranks + a.servers * a.tp
    if a.cpu and a.nodes == 1:
        where = draw(st.sampled_from([word("cpu"), f"1 {word('cpu')} {noun('node')}", None]))
        where = where or word("cpu")
    elif a.cpu:
        where = f"{a.nodes}{sp()}{word('cpu')}{sp()}{noun('node')}"
    elif a.nodes == 1:
        where = draw(st.sampled_from([f"{a.gpus_per_node} {noun('gpu')}",
                                      f"1 {noun('node')}{sp()}{x()}{a.gpus_per_node} {noun('gpu')}"]
                                     + ([None] if exact else [])))
    else:
        where = f"{a.nodes} {noun('node')} {x()}{a.gpus_per_node}{sp()}{noun('gpu')}"
    return text if where is None else f"{text}{sp()}{word('on')}{sp()}{where}"


# -- the grammar -----------------------------------------------------------------------------


@given(allocations())
def test_writing_then_reading_gives_the_same_allocation(a):
    assert str(a) == canonical(a)
    assert Allocation.parse(str(a)) == a


@given(st.data())
def test_every_spelling_reads_as_its_canonical_form(data):
    a = data.draw(allocations())
    text = data.draw(spellings(a))
    assert Allocation.parse(text) == a
    assert str(Allocation.parse(text)) == canonical(a)


@pytest.mark.parametrize(("text", "expected"), [
    (ONE_NODE, Allocation(servers=2, tp=2, ranks=4, gpus_per_node=8)),
    (SLURM, Allocation(servers=4, tp=2, ranks=16, nodes=3, gpus_per_node=8)),
    ("generation: 2 servers, training: 1 rank on cpu",
     Allocation(servers=2, ranks=1, device="cpu")),
    ("training: 1 rank, generation: 1 server on 2 cpu nodes",
     Allocation(servers=1, ranks=1, nodes=2, device="cpu")),
])
def test_examples_read_as_documented(text, expected):
    assert Allocation.parse(text) == expected


QUOTED = re.compile(r"'((?:generation|training|on|inference)[^']*)'")
SUGGESTED = re.compile(r"(?:try|e\.g\.) '([^']+)'")


def assert_names_part_and_suggests(message: str, part: str) -> None:
    """The message quotes `part` and ends with an allocation that is accepted."""
    assert f"'{part}'" in message, message
    suggestion = SUGGESTED.findall(message)
    assert suggestion, message
    Allocation.parse(suggestion[-1])  # raises if the suggestion is not accepted


@pytest.mark.parametrize(("text", "part"), [
    ("generation: four servers, training: 1 rank", "generation: four servers"),
    ("generation: 2 servers x 2, training: 1 rank", "generation: 2 servers x 2"),
    ("generation: 2 servers, training: 1 ranks x tp 2", "training: 1 ranks x tp 2"),
    ("inference: 2 servers, training: 1 rank", "inference: 2 servers"),
    ("generation 2 servers, training: 1 rank", "generation 2 servers"),
    ("generation: 2 servers", "generation: 2 servers"),  # no training part
    ("generation: 2 servers, training: 1 rank, training: 2 ranks", "training: 2 ranks"),
    ("generation: 2 servers, training: 1 rank on 8", "on 8"),
    ("generation: 2 servers, training: 1 rank on 2 nodes x 8", "on 2 nodes x 8"),
    ("generation: 0 servers, training: 1 rank", "generation: 0 servers"),
    ("generation: 1 server x tp 0, training: 1 rank", "generation: 1 server x tp 0"),
    ("generation: 1 server, training: 0 ranks", "training: 0 ranks"),
    ("generation: 1 server, training: 1 rank on 0 gpus", "on 0 gpus"),
    ("generation: 1 server, training: 1 rank on 0 nodes x 8 gpus", "on 0 nodes x 8 gpus"),
    # on cpu a server is one areal-flow serve process
    ("generation: 2 servers x tp 2, training: 1 rank on cpu", "generation: 2 servers x tp 2"),
    # one node: 8 + 4 GPUs do not fit in 8
    ("generation: 4 servers x tp 2, training: 4 ranks on 8 gpus",
     "generation: 4 servers x tp 2"),
    ("generation: 1 server x tp 16, training: 4 ranks on 8 gpus",
     "generation: 1 server x tp 16"),
    # several nodes: tp must divide a node's GPUs
    ("generation: 2 servers x tp 3, training: 8 ranks on 2 nodes x 8 gpus",
     "generation: 2 servers x tp 3"),
    # the servers take both nodes
    ("generation: 8 servers x tp 2, training: 8 ranks on 2 nodes x 8 gpus",
     "on 2 nodes x 8 gpus"),
    # 12 ranks on one 8-GPU training node; 7 ranks on two nodes
    ("generation: 4 servers x tp 2, training: 12 ranks on 2 nodes x 8 gpus",
     "training: 12 ranks"),
    ("generation: 4 servers x tp 2, training: 7 ranks on 3 nodes x 8 gpus", "training: 7 ranks"),
    # CPU nodes: one rank a training node, none left for the servers
    ("generation: 2 servers, training: 2 ranks on 2 cpu nodes", "on 2 cpu nodes"),
    ("generation: 1 server, training: 1 rank on 3 cpu nodes", "on 3 cpu nodes"),
])
def test_each_error_names_the_wrong_part(text, part):
    with pytest.raises(AllocationError) as error:
        Allocation.parse(text)
    assert_names_part_and_suggests(str(error.value), part)


def test_an_empty_allocation_shows_an_example():
    with pytest.raises(AllocationError, match=re.escape(EXAMPLES[0])):
        Allocation.parse("  ")


@settings(max_examples=300)
@given(servers=st.integers(0, 20), tp=st.integers(0, 9), ranks=st.integers(0, 40),
       nodes=st.integers(0, 5), gpus=st.none() | st.integers(0, 10), cpu=st.booleans())
def test_any_rejected_allocation_quotes_a_part_and_suggests_an_accepted_one(
        servers, tp, ranks, nodes, gpus, cpu):
    fields = {"servers": servers, "tp": tp, "ranks": ranks, "nodes": nodes,
              "gpus_per_node": (0 if gpus is None else gpus) if cpu else gpus,
              "device": "cpu" if cpu else "gpu"}
    try:
        Allocation(**fields)
    except AllocationError as error:
        message = str(error)
        assert QUOTED.search(message), message
        suggestion = SUGGESTED.findall(message)
        assert suggestion, message
        Allocation.parse(suggestion[-1])


# -- placement -------------------------------------------------------------------------------


@given(allocations(), st.none() | st.integers(1024, 40000))
def test_placement_runs_every_process_once_and_shares_no_gpu(a, port_base):
    p = a.placement(port_base=port_base)
    assert [s.index for s in p.servers] == list(range(a.servers))
    assert [r.rank for r in p.ranks] == list(range(a.ranks))
    devices = [(s.node, g) for s in p.servers for g in s.gpus] + \
        [(r.node, r.gpu) for r in p.ranks if r.gpu is not None]
    assert len(devices) == len(set(devices))  # no GPU runs two processes
    assert sorted(devices + list(p.idle)) == \
        [(n, g) for n in range(a.nodes) for g in range(a.gpus_per_node)]
    for s in p.servers:
        assert 0 <= s.node < a.nodes
        if a.cpu:
            assert s.gpus == ()
        else:  # tp consecutive GPUs of one node
            assert list(s.gpus) == list(range(s.gpus[0], s.gpus[0] + a.tp))
        if port_base is not None:
            ports = [t.port for t in p.servers if t.node == s.node]
            assert len(set(ports)) == len(ports) and min(ports) == port_base
    per_node = {}
    for r in p.ranks:
        assert 0 <= r.node < a.nodes
        assert r.gpu == (None if a.cpu else r.local_rank)  # the runtime trains on cuda:LOCAL_RANK
        per_node.setdefault(r.node, []).append(r.local_rank)
    # torchrun: the same --nproc-per-node on every training node, local ranks 0..n-1
    assert all(ranks == list(range(a.ranks_per_node)) for ranks in per_node.values())
    if a.nodes > 1:  # no node both generates and trains
        assert not {s.node for s in p.servers} & set(per_node)


def test_one_node_puts_training_first_and_servers_after():
    p = Allocation.parse(ONE_NODE).placement()
    assert [(r.node, r.gpu) for r in p.ranks] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert [(s.node, s.gpus, s.port) for s in p.servers] == [(0, (4, 5), None),
                                                            (0, (6, 7), None)]


def test_table_rows():
    a = Allocation.parse("generation: 1 server x tp 2, training: 1 rank on 4 gpus")
    assert a.placement().rows() == [(0, "GPU 0", "training rank 0", ""),
                                    (0, "GPUs 1-2", "generation server 0", "free"),
                                    (0, "GPU 3", "idle", "")]
    cpu = Allocation.parse("generation: 2 servers, training: 1 rank on cpu").placement(30000)
    assert cpu.rows() == [(0, "cpu", "generation server 0", "30000"),
                          (0, "cpu", "generation server 1", "30001"),
                          (0, "cpu", "training rank 0", "")]


# -- what it sets --------------------------------------------------------------------------


def test_the_launcher_starts_the_servers_where_the_placement_says(tmp_path):
    """The allocation only fills InferenceConfig; SGLangLauncher then puts server i on the
    GPUs placement() shows (the launch logic is the launcher's alone)."""
    from areal_flow.inference.launcher import SGLangLauncher

    a = Allocation.parse(ONE_NODE)
    fields = a.inference_fields()
    assert fields == {"backend": "sglang", "server_gpus": (4, 5, 6, 7), "tp_size": 2}
    launcher = SGLangLauncher("model", gpus=fields["server_gpus"], tp_size=fields["tp_size"],
                              ports=(30000, 30001), log_dir=str(tmp_path))
    launched = [(launch.slot.gpus, launch.env["CUDA_VISIBLE_DEVICES"])
                for launch in launcher.launches()]
    assert launched == [(s.gpus, ",".join(map(str, s.gpus))) for s in a.placement().servers]
    cpu = Allocation.parse("generation: 2 servers, training: 1 rank on cpu").inference_fields()
    assert (cpu["server_program"], cpu["device"], len(cpu["server_gpus"])) == \
        ("areal-flow", "cpu", 2)


def test_slurm_layout_of_the_readme_job():
    from areal_flow.launch.slurm import SlurmJob, server_commands

    a = Allocation.parse(SLURM)
    layout = slurm_layout(a)
    assert attrs.asdict(layout) == {"server_nodes": 1, "training_nodes": 2,
                                    "servers_per_node": 4, "gpus_per_node": 8, "tp": 2,
                                    "ranks_per_node": 8}
    # README: areal-flow slurm --nodes 2 --server-nodes 1 --servers-per-node 4 (8 GPUs a node)
    job = SlurmJob(model="m", **layout.job_fields())
    assert (job.nodes, job.server_nodes, job.servers_per_node, job.tp_size) == (2, 1, 4, 2)
    # each server node runs the servers placement() puts on node 0, at the same ports
    servers = [(port, devices) for port, devices, _ in server_commands(job)]
    assert servers == [(s.port, ",".join(map(str, s.gpus)))
                       for s in a.placement(port_base=job.port_base).servers]


def test_slurm_layout_of_cpu_nodes():
    from areal_flow.launch.slurm import SlurmJob, check

    layout = slurm_layout(Allocation.parse("generation: 2 servers, training: 1 rank on "
                                           "2 cpu nodes"))
    fields = layout.job_fields()
    assert fields == {"nodes": 1, "server_nodes": 1, "gpus_per_node": 0, "servers_per_node": 2,
                      "server_program": "areal-flow"}
    check(SlurmJob(model="m", **fields))


@pytest.mark.parametrize(("text", "part"), [
    (ONE_NODE, "on 8 gpus"),  # a SLURM job does not share nodes
    ("generation: 1 server, training: 1 rank on cpu", "on cpu"),
    ("generation: 3 servers x tp 2, training: 8 ranks on 2 nodes x 8 gpus",
     "generation: 3 servers x tp 2"),  # GPUs 6-7 of the server node idle
    ("generation: 4 servers x tp 2, training: 8 ranks on 3 nodes x 8 gpus",
     "training: 8 ranks"),  # 4 ranks a node, SlurmJob runs 8
    ("generation: 3 servers, training: 1 rank on 3 cpu nodes", "generation: 3 servers"),
])
def test_slurm_layout_refuses_what_a_slurm_job_cannot_run(text, part):
    with pytest.raises(AllocationError) as error:
        slurm_layout(Allocation.parse(text))
    assert_names_part_and_suggests(str(error.value), part)
    # and the suggestion is one it can run
    slurm_layout(Allocation.parse(SUGGESTED.findall(str(error.value))[-1]))


@pytest.mark.parametrize(("world", "local", "gpus", "addresses", "message"), [
    (1, 1, 8, False, "torchrun --nproc-per-node 4 recipe.py --steps 2"),
    (4, 4, 4, False, "'on 8 gpus' but this node has 4 visible GPUs"),
])
def test_a_wrong_start_is_refused_with_the_command_to_use(world, local, gpus, addresses,
                                                          message):
    a = Allocation.parse(ONE_NODE)
    with pytest.raises(AllocationError, match=re.escape(message)):
        a.check_launch(world_size=world, local_world_size=local, visible_gpus=gpus,
                       has_addresses=addresses, command=["recipe.py", "--steps", "2"])
    a.check_launch(world_size=4, local_world_size=4, visible_gpus=8, has_addresses=False,
                   command=["recipe.py"])


def test_several_nodes_need_the_servers_addresses_and_torchrun_on_each_training_node():
    a = Allocation.parse(SLURM)
    assert launch_command(a, ["r.py"]) == (
        "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "
        "FIRST_TRAINING_NODE:29500 r.py --inference.addresses-file FILE")
    with pytest.raises(AllocationError, match="--inference.addresses-file"):
        a.check_launch(world_size=16, local_world_size=8, visible_gpus=8, has_addresses=False,
                       command=["r.py"])
    with pytest.raises(AllocationError, match="8 on this node"):
        a.check_launch(world_size=16, local_world_size=16, visible_gpus=16, has_addresses=True,
                       command=["r.py"])
    a.check_launch(world_size=16, local_world_size=8, visible_gpus=8, has_addresses=True,
                   command=["r.py"])


# -- the recipe config -----------------------------------------------------------------------


def test_the_recipe_config_takes_the_inference_settings_from_the_allocation():
    cfg = rl_recipes.cli(rl_recipes.RLConfig, ["--allocation", ONE_NODE])
    assert cfg.allocation == str(Allocation.parse(ONE_NODE))  # kept as its canonical line
    assert (cfg.inference.backend, cfg.inference.server_gpus, cfg.inference.tp_size) == \
        ("sglang", (4, 5, 6, 7), 2)
    # config.yaml holds the allocation as its one line, and reads back to the same config
    data = config.unstructure(cfg)
    assert data["allocation"] == cfg.allocation
    assert config.structure(rl_recipes.RLConfig, json.loads(json.dumps(data))) == cfg
    # without --allocation the old options work as before
    old = rl_recipes.cli(rl_recipes.RLConfig, ["--inference.backend", "sglang",
                                           "--inference.server-gpus", "4", "5", "6", "7",
                                           "--inference.tp-size", "2"])
    assert old.inference == cfg.inference and old.allocation is None


@pytest.mark.parametrize("flags", [
    ["--inference.server-gpus", "0", "1"],
    ["--inference.server-gpus", "0"],  # the default's value, given: refused as well
    ["--inference.backend=local"],
    ["--inference.tp_size", "2"],
])
def test_an_old_option_with_allocation_is_refused_showing_the_allocation(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        rl_recipes.cli(rl_recipes.RLConfig, ["--allocation", ONE_NODE, *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    flag = flags[0].split("=")[0].replace("_", "-")
    assert err.startswith(f"error: {flag}")
    assert f"--allocation '{Allocation.parse(ONE_NODE)}'" in err


def test_a_config_built_in_code_refuses_a_conflicting_inference_setting():
    with pytest.raises(AllocationError, match="--inference.tp-size 4"):
        rl_recipes.RLConfig(allocation=Allocation.parse(ONE_NODE),
                          inference=InferenceConfig(tp_size=4))
    # values equal to the allocation's are not a conflict (e.g. attrs.evolve of a built config)
    cfg = rl_recipes.RLConfig(allocation=Allocation.parse(ONE_NODE))
    assert attrs.evolve(cfg, steps=3).inference == cfg.inference


# -- the recipe, end to end ------------------------------------------------------------------


def recipe(*args: str, launcher: tuple[str, ...] = (), timeout: float = 120):
    """recipes/gsm8k_grpo.py ARGS, its messages on one line each (a wide terminal)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "300", "PYTHONPATH": str(ROOT)}
    return subprocess.run([*(launcher or (sys.executable,)), "recipes/gsm8k_grpo.py", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


NOTHING = ("--model", "/no/such/model", "--dataset", "/no/such/rows.jsonl")
"""A dry run must read neither: a run that did would fail on these."""


def table(stdout: str) -> list[list[str]]:
    """The placement table's rows, split into cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["node", "device"])
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_dry_run_of_the_readme_one_node_example(tmp_path):
    result = recipe(*NOTHING, "--run-dir", str(tmp_path / "run"), "--allocation", ONE_NODE,
                    "--steps", "3", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert table(result.stdout) == [
        ["0", "GPU 0", "training rank 0"], ["0", "GPU 1", "training rank 1"],
        ["0", "GPU 2", "training rank 2"], ["0", "GPU 3", "training rank 3"],
        ["0", "GPUs 4-5", "generation server 0", "free"],
        ["0", "GPUs 6-7", "generation server 1", "free"]]
    assert ("torchrun --nproc-per-node 4 recipes/gsm8k_grpo.py --model /no/such/model "
            f"--dataset /no/such/rows.jsonl --run-dir {tmp_path / 'run'} --allocation "
            f"'{ONE_NODE}' --steps 3") in result.stdout
    assert not (tmp_path / "run").exists()  # nothing started


def test_dry_run_of_the_readme_slurm_example():
    result = recipe(*NOTHING, "--allocation", SLURM, "--rollout.batch-size", "64", "--dry-run")
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert rows[:4] == [["0", f"GPUs {2 * i}-{2 * i + 1}", f"generation server {i}",
                         str(30000 + i)] for i in range(4)]
    assert rows[4:] == [[str(1 + r // 8), f"GPU {r % 8}", f"training rank {r}"]
                        for r in range(16)]
    # the README's areal-flow slurm command for the same layout
    assert ("areal-flow slurm --model /no/such/model --nodes 2 --server-nodes 1 "
            "--gpus-per-node 8 --servers-per-node 4 --out job.sh -- --dataset "
            "/no/such/rows.jsonl --rollout.batch-size 64") in result.stdout


@pytest.mark.parametrize(("allocation", "message"), [
    ("generation: 4 servers x tp 2, training: 4 ranks on 8 gpus",
     "'generation: 4 servers x tp 2' (8 GPUs) and 'training: 4 ranks' (4) need 12 GPUs"),
    ("generation: 2 servers, training: one rank", "'training: one rank'"),
])
def test_a_bad_allocation_fails_at_start_with_exit_2(allocation, message):
    result = recipe(*NOTHING, "--allocation", allocation)
    assert result.returncode == 2
    assert message in result.stdout + result.stderr


def test_a_torchrun_world_other_than_the_training_ranks_fails_at_start():
    result = recipe(*NOTHING, "--allocation", "generation: 1 server, training: 2 ranks on cpu")
    assert result.returncode == 2
    assert "start it with\n  torchrun --nproc-per-node 2 recipes/gsm8k_grpo.py" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_gpus_this_node_lacks_fail_at_start():
    result = recipe(*NOTHING, "--allocation", "generation: 1 server, training: 1 rank")
    assert result.returncode == 2
    assert "'on 2 gpus' but this node has 0 visible GPUs" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="'on cpu' refuses visible GPUs")
def test_a_cpu_allocation_runs_the_recipe(tiny_model_dir, gsm8k_file, tmp_path):
    run = tmp_path / "run"
    result = recipe("--model", str(tiny_model_dir), "--dataset", str(gsm8k_file), "--run-dir",
                    str(run), "--steps", "1", "--eval-size", "2", "--rollout.batch-size", "2",
                    "--rollout.group-size", "2", "--sampling.max-new-tokens", "8",
                    "--inference.dtype", "float32", "--train.dtype", "float32",
                    "--allocation", "generation: 2 servers, training: 1 rank on cpu",
                    timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list((run / "servers").glob("server-*.log"))) == 2  # two areal-flow serve
    trained = [m for m in metrics(run) if m["step"] == 1]
    assert trained and trained[0]["pool/requests"] > 0  # generated by those servers
    saved = (run / "config.yaml").read_text()
    assert "allocation: 'generation: 2 servers, training: 1 rank on cpu'" in saved
    assert "server_program: areal-flow" in saved and "backend: sglang" in saved
