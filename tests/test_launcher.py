"""The SGLang launcher: the commands and environments it builds, a server that dies at start,
`areal-flow serve` launched through the command override, and stopping whole process groups (by
`stop()`, and by SIGTERM/SIGINT of the parent). Fake servers are small Python programs."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from areal_flow.inference.launcher import (
    ServerLaunchError,
    SGLangLauncher,
    serve_command,
    sglang_command,
)
from tests.test_protocol_server import wait_for

# Answers GET /health with 200; with an argument, first starts a child that sleeps (same group).
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    if "--with-child" in sys.argv:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("child", child.pid, flush=True)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


def fake_command(*extra: str):
    def command(launcher, slot):
        return [sys.executable, "-c", FAKE_SERVER, "--port", str(slot.port), *extra]

    return command


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by someone else is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_the_sglang_command_and_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    monkeypatch.setenv("KEEP_ME", "yes")
    launcher = SGLangLauncher("/models/qwen", gpus=[4, 5, 6, 7], tp_size=2,
                              mem_fraction_static=0.7, ports=[31000, 31001], random_seed=3,
                              skip_tokenizer_init=True, log_dir=str(tmp_path),
                              extra_args=["--enable-memory-saver"], env={"EXTRA": "1"})
    assert launcher.command is sglang_command and launcher.num_servers == 2
    first, second = launcher.launches()
    assert list(first.argv) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/qwen",
        "--host", "127.0.0.1", "--port", "31000", "--tp-size", "2",
        "--mem-fraction-static", "0.7", "--skip-tokenizer-init", "--random-seed", "3",
        "--weight-version", "0", "--log-level", "warning", "--enable-memory-saver"]
    assert second.argv[second.argv.index("--port") + 1] == "31001"
    assert (first.env["CUDA_VISIBLE_DEVICES"], second.env["CUDA_VISIBLE_DEVICES"]) == ("4,5", "6,7")
    for launch in (first, second):
        assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in launch.env
        assert launch.env["KEEP_ME"] == "yes" and launch.env["EXTRA"] == "1"
        assert launch.log_path.parent == tmp_path
    assert first.log_path != second.log_path

    plain = SGLangLauncher("m", gpus=[0, 1, 2]).launches()  # free ports, one GPU each
    assert [launch.env["CUDA_VISIBLE_DEVICES"] for launch in plain] == ["0", "1", "2"]
    assert len({launch.slot.port for launch in plain}) == 3
    assert "--skip-tokenizer-init" not in plain[0].argv and "--random-seed" not in plain[0].argv
    assert "--enable-deterministic-inference" not in plain[0].argv
    # a description names a fresh log folder and makes none (`start` does)
    folder = plain[0].log_path.parent
    assert folder.name.startswith("areal-flow-sglang-") and not folder.exists()
    assert {launch.log_path.parent for launch in plain} == {folder}
    # seeds are honoured by SGLang only with deterministic inference; None leaves "default"
    (seeded,) = SGLangLauncher("m", deterministic_inference=True, weight_version=None).launches()
    assert "--enable-deterministic-inference" in seeded.argv
    assert "--weight-version" not in seeded.argv


def flag(argv, name: str) -> str:
    return argv[list(argv).index(name) + 1]


def test_from_config_launches_with_the_inference_settings(monkeypatch):
    """The recipe's InferenceConfig reaches the launched servers' command lines."""
    from areal_flow.config import InferenceConfig
    from areal_flow.inference.sglang_pool import SGLangPool

    launched = []

    def start(launcher):
        launched.extend(launcher.launches())
        raise ServerLaunchError("not started in this test")

    monkeypatch.setattr(SGLangLauncher, "start", start)
    for program in ("sglang", "areal-flow"):
        config = InferenceConfig(backend="sglang", server_program=program, deterministic=True,
                                 dtype="float32", max_batch_size=3, device="cuda:0")
        with pytest.raises(ServerLaunchError):
            SGLangPool.from_config(config, model="m", seed=5)
    sglang, serve = (launch.argv for launch in launched)
    assert "--enable-deterministic-inference" in sglang
    assert flag(sglang, "--weight-version") == "0" and flag(sglang, "--random-seed") == "5"
    assert serve[1:4] == ("-m", "areal_flow.cli", "serve")
    assert (flag(serve, "--dtype"), flag(serve, "--max-batch-size"), flag(serve, "--device"),
            flag(serve, "--weight-version"), flag(serve, "--seed")) == (
        "float32", "3", "cuda:0", "0", "5")


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"gpus": [0, 1, 2], "tp_size": 2}, "gpus"),
    ({"gpus": []}, "gpus"),
    ({"gpus": [0, 1], "ports": [1]}, "ports"),
    ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ({"env": {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}}, "SGLANG_RETURN_ORIGINAL_LOGPROB"),
])
def test_bad_settings_are_refused_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SGLangLauncher("m", **kwargs)


def test_a_server_that_dies_at_start_gives_its_last_log_lines(tmp_path):
    def dying(launcher, slot):
        code = ("import sys\nfor i in range(100): print('warming up', i, flush=True)\n"
                "print('RuntimeError: no CUDA GPUs are available', file=sys.stderr)\nsys.exit(3)")
        return [sys.executable, "-c", code]

    healthy = fake_command()
    commands = iter([healthy, dying])
    launcher = SGLangLauncher("m", gpus=[0, 1], log_dir=str(tmp_path),
                              command=lambda launcher, slot: next(commands)(launcher, slot))
    with pytest.raises(ServerLaunchError) as failure:
        launcher.start()
    message = str(failure.value)
    assert "SGLang server 1" in message and "exited with status 3" in message
    assert "RuntimeError: no CUDA GPUs are available" in message
    assert "warming up 99" in message and "warming up 10\n" not in message  # the last lines only
    assert launcher.processes == []  # the healthy one was stopped too


def test_a_server_that_never_answers_times_out_with_its_log(tmp_path):
    def silent(launcher, slot):
        return [sys.executable, "-c", "print('loading...', flush=True)\nimport time\n"
                                      "time.sleep(600)"]

    launcher = SGLangLauncher("m", startup_timeout=0.5, log_dir=str(tmp_path), command=silent)
    with pytest.raises(ServerLaunchError, match=r"did not answer /health within 0.5 s(.|\n)*"
                                                r"loading\.\.\."):
        launcher.start()
    assert launcher.processes == []


def test_stop_kills_the_whole_process_group(tmp_path):
    launcher = SGLangLauncher("m", gpus=[0], log_dir=str(tmp_path),
                              command=fake_command("--with-child"))
    launcher.start()
    server = launcher.processes[0]
    assert os.getpgid(server.pid) == server.pid  # a group of its own
    log = next(tmp_path.iterdir())
    wait_for(lambda: "child" in log.read_text(), what="the child pid in the log")
    child = int(log.read_text().split()[1])
    assert alive(child) and os.getpgid(child) == server.pid
    launcher.stop()
    assert server.poll() is not None
    wait_for(lambda: not alive(child), what="the server's child to be killed")


def test_launching_areal_flow_serve_through_the_override(tiny_model_dir, tmp_path):
    """The engine settings bound to `serve_command` reach the server, which starts with them
    (its command line refuses unknown flags) and reports the launcher's weight version."""
    listing = tmp_path / "servers.txt"
    command = functools.partial(serve_command, dtype="bfloat16", max_batch_size=2, device="cpu")
    launcher = SGLangLauncher(tiny_model_dir, gpus=[0], command=command, weight_version=7,
                              addresses_file=str(listing), log_dir=str(tmp_path / "servers"))
    try:
        (address,) = launcher.start()
        assert listing.read_text() == f"{address}\n"
        assert httpx.get(f"http://{address}/health").status_code == 200
        argv = Path(f"/proc/{launcher.processes[0].pid}/cmdline").read_text().split("\0")
        assert (flag(argv, "--dtype"), flag(argv, "--max-batch-size"), flag(argv, "--device")) == (
            "bfloat16", "2", "cpu")
        assert httpx.get(f"http://{address}/model_info").json()["weight_version"] == "7"
        out = httpx.post(f"http://{address}/generate", timeout=30, json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert len(out.json()["output_ids"]) <= 3
        server = launcher.processes[0]
    finally:
        launcher.stop()
    assert server.poll() is not None and launcher.processes == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{address}/health")


PARENT = textwrap.dedent("""
    import sys, time
    from areal_flow.inference.launcher import SGLangLauncher
    fake = sys.argv[2]
    launcher = SGLangLauncher("m", gpus=[0], log_dir=sys.argv[1], command=lambda launcher, slot: [
        sys.executable, "-c", fake, "--port", str(slot.port)])
    launcher.start()
    try:  # the test signals once it has read the pid: from then on the handler must be inside
        print(launcher.processes[0].pid, flush=True)
        time.sleep(600)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(7)
""")


@pytest.mark.faults
@pytest.mark.parametrize(("signum", "exit_status"), [(signal.SIGTERM, -signal.SIGTERM),
                                                     (signal.SIGINT, 7)])
def test_the_parent_stopping_on_a_signal_stops_its_servers(tmp_path, signum, exit_status):
    """The handlers stop the servers, then chain to the previous ones (default SIGTERM ends the
    process; default SIGINT raises KeyboardInterrupt)."""
    # SIGINT at its default, as in a terminal: a shell without job control starts background
    # jobs (`cmd &`, CI runners) with SIGINT ignored, and the parent would inherit that
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), FAKE_SERVER],
                              stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        server = int(parent.stdout.readline())
        assert alive(server)
        parent.send_signal(signum)
        assert parent.wait(90) == exit_status  # once timed out at 30 s under a loaded CI run
    finally:
        if parent.poll() is None:
            parent.kill()
    assert not alive(server)


@pytest.mark.faults
def test_a_parent_killed_outright_takes_its_servers_with_it(tmp_path):
    """SIGKILL runs no handler and no atexit: the kernel's parent-death signal stops the server."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), FAKE_SERVER],
                              stdout=subprocess.PIPE, text=True)
    server = None
    try:
        server = int(parent.stdout.readline())
        assert alive(server)
        parent.kill()
        assert parent.wait(30) == -signal.SIGKILL
        wait_for(lambda: not alive(server), what="the orphaned server to stop")
    finally:
        if parent.poll() is None:
            parent.kill()
        if server is not None and alive(server):
            os.kill(server, signal.SIGKILL)
