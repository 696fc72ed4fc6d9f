"""Start SGLang servers as subprocesses, wait until they answer, and stop them with the recipe.

Each server gets `tp_size` GPUs of the list it is given (``CUDA_VISIBLE_DEVICES``), a port, a log
file, and its own process group, so stopping it (SIGTERM to the group, SIGKILL after
`stop_timeout`) also stops the scheduler and detokenizer processes SGLang starts. Servers are
stopped by `stop()`, at interpreter exit, and when this process gets SIGINT or SIGTERM (the handlers
then chain to the ones installed before). A launcher killed outright (SIGKILL, the OOM killer)
runs none of these: on Linux each server also asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``; the parent is the thread that called `start`, so call it from a thread
that lives as long as the servers should). ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is never set and is
removed from the inherited environment: behavior logprobs must be taken after temperature
(docs/architecture.md, "Launcher").

The command is built by a function of (launcher, slot): `sglang_command` by default;
`serve_command` starts ``areal-flow serve`` instead (CPU machines and tests). Servers start with
``--weight-version`` (the pool's integer label, instead of SGLang's ``"default"``), and, when
asked, with ``--enable-deterministic-inference``, without which SGLang ignores per-request
``sampling_seed``.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import attrs
import httpx

log = logging.getLogger(__name__)

FORBIDDEN_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
LOG_TAIL_LINES = 40


class ServerLaunchError(RuntimeError):
    """A server exited while starting, or did not answer ``/health`` in time."""


@attrs.frozen
class ServerSlot:
    """Where one server runs."""

    index: int
    host: str
    port: int
    gpus: tuple[int, ...]

    @property
    def address(self) -> str:
        """``host:port`` as clients reach it (a wildcard host is replaced by this host's name)."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"


@attrs.frozen
class ServerLaunch:
    """One server's command line, environment and log file."""

    slot: ServerSlot
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path


def sglang_command(launcher: SGLangLauncher, slot: ServerSlot) -> list[str]:
    """``python -m sglang.launch_server`` with the launcher's settings."""
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", launcher.model_path,
        "--host", slot.host,
        "--port", str(slot.port),
        "--tp-size", str(launcher.tp_size),
        "--mem-fraction-static", str(launcher.mem_fraction_static),
    ]
    if launcher.skip_tokenizer_init:
        argv.append("--skip-tokenizer-init")
    if launcher.random_seed is not None:
        argv += ["--random-seed", str(launcher.random_seed)]
    if launcher.weight_version is not None:
        argv += ["--weight-version", str(launcher.weight_version)]
    if launcher.deterministic_inference:
        argv.append("--enable-deterministic-inference")
    if launcher.log_level is not None:
        argv += ["--log-level", launcher.log_level]
    return [*argv, *launcher.extra_args]


def serve_command(launcher: SGLangLauncher, slot: ServerSlot, *, dtype: str | None = None,
                  max_batch_size: int | None = None, device: str | None = None) -> list[str]:
    """``areal-flow serve``: the SGLang protocol over the local engine (no GPU needed). The
    engine's settings are bound with `functools.partial` (None: the command's default)."""
    argv = [sys.executable, "-m", "areal_flow.cli", "serve", "--model", launcher.model_path,
            "--host", slot.host, "--port", str(slot.port)]
    options = {"--seed": launcher.random_seed, "--weight-version": launcher.weight_version,
               "--dtype": dtype, "--max-batch-size": max_batch_size, "--device": device}
    for flag, value in options.items():
        if value is not None:
            argv += [flag, str(value)]
    return [*argv, *launcher.extra_args]


SGLANG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head", "all")
"""The ``--lora-target-modules`` SGLang's launcher accepts (a fixed list; "all" is all-linear)."""


def lora_args(program: str, lora: Any = None) -> tuple[str, ...]:
    """A server's options for the trainer's LoRA (`areal_flow.lora.LoraConfig`; none without):
    SGLang sizes its adapter memory pool at start, for the rank and modules given."""
    if lora is None or not lora.enabled:
        return ()
    if program == "areal-flow":
        return ("--enable-lora",)
    targets = ["all"] if lora.target_modules == ("all-linear",) else list(lora.target_modules)
    unknown = [t for t in targets if t not in SGLANG_LORA_TARGETS]
    if unknown:  # SGLang's launcher would exit on them, after minutes of loading
        raise ValueError(f"'--train.lora.target-modules' {unknown} are not module names SGLang "
                         f"serves adapters on; allowed: all-linear, or some of "
                         f"{' '.join(SGLANG_LORA_TARGETS[:-1])}")
    return ("--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *targets)


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"'{attribute.name}' must be > 0: {value!r}")


@attrs.define
class _Running:
    launch: ServerLaunch
    process: subprocess.Popen
    log_file: IO[bytes]


@attrs.define
class SGLangLauncher:
    """Starts ``len(gpus) / tp_size`` servers of `model_path` (see the module docstring).

    Use as a context manager, or call `start()` and `stop()`.
    """

    model_path: str = attrs.field(converter=str)
    gpus: tuple[int, ...] = attrs.field(default=(0,), converter=tuple)
    """GPU ids, `tp_size` consecutive ones per server."""
    tp_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    mem_fraction_static: float = attrs.field(
        default=0.8, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])
    """Fraction of GPU memory SGLang takes for weights and KV cache."""
    host: str = "127.0.0.1"
    ports: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple))
    """One port per server; free ports are picked when None."""
    skip_tokenizer_init: bool = False
    random_seed: int | None = None
    weight_version: int | None = 0
    """The version servers report at start (the pool's first label); None: SGLang's "default"."""
    deterministic_inference: bool = False
    """SGLang honours per-request sampling seeds only with this (it is slower)."""
    log_level: str | None = "warning"
    log_dir: str | None = None
    """Where the servers' logs go (a new temporary folder when None)."""
    addresses_file: str | None = None
    """Written with one ``host:port`` a line once every server answers (for `SGLangPool`)."""
    startup_timeout: float = attrs.field(default=600.0, validator=_positive)
    stop_timeout: float = attrs.field(default=30.0, validator=_positive)
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    env: Mapping[str, str] = attrs.field(factory=dict)
    """Extra environment variables for every server."""
    command: Callable[[SGLangLauncher, ServerSlot], list[str]] = sglang_command
    """Builds a server's command line (`sglang_command`, `serve_command`, or your own)."""

    _running: list[_Running] = attrs.field(factory=list, init=False)
    _handlers: dict[int, tuple[object, object]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if not self.gpus or len(self.gpus) % self.tp_size:
            raise ValueError(f"'gpus' must hold a positive multiple of tp_size={self.tp_size} "
                             f"ids: {list(self.gpus)}")
        if self.ports is not None and len(self.ports) != self.num_servers:
            raise ValueError(f"'ports' must hold one port per server ({self.num_servers}): "
                             f"{list(self.ports)}")
        if FORBIDDEN_ENV in self.env:
            raise ValueError(f"{FORBIDDEN_ENV} is never set: behavior logprobs are taken after "
                             "temperature (the episode's log-probs are at its sampling temperature)")

    @property
    def num_servers(self) -> int:
        return len(self.gpus) // self.tp_size

    @property
    def addresses(self) -> list[str]:
        return [r.launch.slot.address for r in self._running]

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The running servers' processes (each leads its own process group)."""
        return [r.process for r in self._running]

    def launches(self) -> list[ServerLaunch]:
        """The command, environment and log file of every server (free ports are picked now when
        no `ports` were given)."""
        ports = self.ports or tuple(_free_port(self.host) for _ in range(self.num_servers))
        # named, not made: `start` makes it (a description of the servers writes nothing)
        log_dir = Path(self.log_dir) if self.log_dir else \
            Path(tempfile.gettempdir()) / f"areal-flow-sglang-{secrets.token_hex(4)}"
        inherited = {k: v for k, v in os.environ.items() if k != FORBIDDEN_ENV}
        launches = []
        for i, port in enumerate(ports):
            gpus = self.gpus[i * self.tp_size:(i + 1) * self.tp_size]
            slot = ServerSlot(index=i, host=self.host, port=port, gpus=gpus)
            env = {**inherited, **self.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
            launches.append(ServerLaunch(slot=slot, argv=tuple(self.command(self, slot)), env=env,
                                         log_path=log_dir / f"server-{i}-port-{port}.log"))
        return launches

    def start(self) -> list[str]:
        """Start every server and wait until each answers ``GET /health`` with 200; returns their
        addresses. On failure every server is stopped and `ServerLaunchError` names the one that
        failed, with the last lines of its log."""
        if self._running:
            raise RuntimeError("the servers are running already")
        launches = self.launches()
        self._install_handlers()
        atexit.register(self.stop)
        try:
            for launch in launches:
                launch.log_path.parent.mkdir(parents=True, exist_ok=True)
                log_file = open(launch.log_path, "ab")  # noqa: SIM115 (closed by stop())
                process = subprocess.Popen(
                    launch.argv, env=dict(launch.env), stdin=subprocess.DEVNULL, stdout=log_file,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=functools.partial(_die_with_parent, os.getpid()),
                )
                self._running.append(_Running(launch, process, log_file))
                log.info("started SGLang server %d (pid %d): %s", launch.slot.index, process.pid,
                         shlex.join(launch.argv))
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        if self.addresses_file is not None:
            _write_atomically(Path(self.addresses_file), "".join(f"{a}\n" for a in self.addresses))
        return self.addresses

    def stop(self) -> None:
        """Stop every server: SIGTERM to its process group, SIGKILL after `stop_timeout`."""
        running, self._running = self._running, []
        for r in running:
            _signal_group(r.process, signal.SIGTERM)
        for r in running:
            try:
                r.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("SGLang server %d did not stop in %s s; killing it",
                            r.launch.slot.index, self.stop_timeout)
        for r in running:
            _signal_group(r.process, signal.SIGKILL)  # whatever is left of the group
            r.process.kill()
            r.process.wait()
            r.log_file.close()
        atexit.unregister(self.stop)
        self._restore_handlers()

    def __enter__(self) -> SGLangLauncher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- waiting -------------------------------------------------------------------------------

    def _wait_until_healthy(self) -> None:
        """Poll every server (an external process: polling is all there is) until it answers."""
        pending = list(self._running)
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.02
        with httpx.Client(timeout=5.0) as client:
            while True:
                pending = [r for r in pending if not _healthy(client, r)]
                if not pending:
                    return
                if time.monotonic() > deadline:
                    raise ServerLaunchError(_describe(
                        pending[0], f"did not answer /health within {self.startup_timeout} s "
                                    f"({len(pending)} of {len(self._running)} servers not ready)"))
                time.sleep(delay)
                delay = min(delay * 2, 0.2)

    # -- signals -------------------------------------------------------------------------------

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.info("not on the main thread: SIGINT/SIGTERM will not stop the SGLang servers")
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            handler = functools.partial(self._on_signal, previous)
            signal.signal(signum, handler)
            self._handlers[signum] = (previous, handler)

    def _restore_handlers(self) -> None:
        handlers, self._handlers = self._handlers, {}
        for signum, (previous, ours) in handlers.items():
            # another handler installed on top of ours still chains to ours; leave it
            if signal.getsignal(signum) is ours and previous is not None:
                signal.signal(signum, previous)

    def _on_signal(self, previous: object, signum: int, frame: object) -> None:
        self.stop()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _healthy(client: httpx.Client, r: _Running) -> bool:
    status = r.process.poll()
    if status is not None:
        raise ServerLaunchError(_describe(r, f"exited with status {status} while starting"))
    slot = r.launch.slot
    host = "127.0.0.1" if slot.host in ("0.0.0.0", "") else slot.host
    try:
        return client.get(f"http://{host}:{slot.port}/health").status_code == 200
    except httpx.TransportError:
        return False


def _describe(r: _Running, what: str) -> str:
    """What went wrong with a server, with the last lines of its log."""
    r.log_file.flush()
    try:
        lines = r.launch.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        lines = []
    slot = r.launch.slot
    return (f"SGLang server {slot.index} ({slot.address}, GPUs {list(slot.gpus)}) {what}.\n"
            f"command: {shlex.join(r.launch.argv)}\nlog: {r.launch.log_path}\n"
            f"last {len(lines)} log lines:\n" + "\n".join(lines))


def _die_with_parent(parent: int) -> None:
    """In the forked server, before exec: SIGTERM when the parent dies (Linux; elsewhere only
    the parent's handlers stop servers). A parent that died before this ran is caught after."""
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# looked up now: loading a library in the forked child could deadlock on a lock held at fork
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)  # the server leads its own group (start_new_session)
    except ProcessLookupError:
        pass


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("", "::") else "0.0.0.0", 0))
        return s.getsockname()[1]


def _write_atomically(path: Path, text: str) -> None:
    """Readers (the pool) never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
