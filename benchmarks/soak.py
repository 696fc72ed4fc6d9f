"""Soak: the GSM8K GRPO recipe on the tiny model for `--minutes`, a random fault every
`--fault-every` seconds, then the same number of steps without faults; compares what was trained.

Faults, drawn with `--seed`:
- server_kill: SIGKILL one of the two `areal-flow serve` servers; it is started again on the same
  port 5 s later (as a supervisor would) and must rejoin with the current weights;
- server_freeze: SIGSTOP one server for 20 s, then SIGCONT;
- reward_crash: SIGKILL one reward worker process;
- trainer_kill: SIGKILL the trainer, then start it again with `--resume`;
- second_run: start a second trainer with `--resume` on the live run's folder: it must be
  refused at start, naming the live run (run_lock.py), and the first run goes on.

The reward (`tests.leaking_text_hash`) keeps 10 MB per call in its worker: the workers are
replaced above `--reward-worker-max-rss-gb 1`, and the report has the largest worker and the
largest process tree seen (`reward_runner/worker_rss_gb`, `memory/tree_rss_gb`).

The run is synchronous (η = 0) with sampling, so the fault-free run is the reference for the data
order (every prompt trained exactly once, in the same order) and, as far as determinism allows,
the weights: a request cut off by a dead server is finished elsewhere with a seed derived from the
tokens so far, so its completion differs from the fault-free one from there on.

    python benchmarks/soak.py --minutes 30 --out benchmarks/results/soak
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gsm8k_grpo.py"
FAULTS = ("server_kill", "server_freeze", "reward_crash", "trainer_kill", "second_run")
WORKER_RSS_LIMIT_GB = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    except OSError:
        return []


class Server:
    """An `areal-flow serve` process on a fixed port, restartable."""

    def __init__(self, model: Path, port: int, log: Path):
        self.model, self.port, self.log = model, port, log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(
                ["areal-flow", "serve", "--model", str(self.model), "--port", str(self.port),
                 "--max-batch-size", "16"], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"})

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait()


def recipe_args(model: Path, data: Path, run_dir: Path, addresses: Path, steps: int) -> list[str]:
    return [sys.executable, str(RECIPE), "--model", str(model), "--dataset", str(data),
            "--run-dir", str(run_dir), "--steps", str(steps), "--save-every", "1",
            "--eval-size", "0", "--inference.backend", "sglang",
            "--inference.addresses-file", str(addresses),
            "--inference.request-timeout", "120", "--inference.no-server-timeout", "120",
            "--rollout.batch-size", "4", "--rollout.group-size", "4",
            "--rollout.max-staleness", "0", "--sampling.max-new-tokens", "48",
            "--samples-per-step", "16", "--reward", "tests.rewards_for_tests:leaking_text_hash",
            "--reward-worker-max-rss-gb", str(WORKER_RSS_LIMIT_GB),
            "--inference.dtype", "float32", "--train.dtype", "float32", "--train.optim.lr", "1e-3"]


def run(out: Path, model: Path, data: Path, *, minutes: float | None, steps: int,
        fault_every: float, seed: int) -> dict:
    """One run: with faults for `minutes` (then SIGTERM), or without faults for `steps`."""
    rng = random.Random(seed)
    run_dir = out / "run"
    servers = [Server(model, free_port(), out / f"server{i}.log") for i in range(2)]
    addresses = out / "addresses"
    addresses.write_text("".join(f"127.0.0.1:{s.port}\n" for s in servers))
    for s in servers:
        s.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = open(out / "trainer.log", "a")
    args = recipe_args(model, data, run_dir, addresses, steps)

    def trainer(resume: bool) -> subprocess.Popen:
        return subprocess.Popen(args + (["--resume"] if resume else []), cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)

    events: list[dict] = []
    begin = time.monotonic()
    process = trainer(resume=False)
    next_fault = begin + fault_every
    stopping = False
    thawing: list[tuple[float, Server]] = []
    restarting: list[tuple[float, Server]] = []
    try:
        while True:
            now = time.monotonic()
            for at, server in [*thawing]:
                if now >= at:
                    os.kill(server.process.pid, signal.SIGCONT)
                    thawing.remove((at, server))
            for at, server in [*restarting]:
                if now >= at:
                    server.start()
                    restarting.remove((at, server))
            code = process.poll()
            if code is not None:
                if stopping or code == 0:
                    break
                if events and events[-1]["fault"] == "trainer_kill" and code == -9:
                    process = trainer(resume=True)
                else:
                    raise RuntimeError(f"the trainer exited with {code}; see {out}/trainer.log")
            if minutes is not None and not stopping and now - begin > minutes * 60:
                process.send_signal(signal.SIGTERM)  # checkpoint and stop
                stopping = True
            if minutes is not None and not stopping and now >= next_fault:
                next_fault = now + fault_every * rng.uniform(0.5, 1.5)
                fault = rng.choice(FAULTS)
                if fault == "trainer_kill" and not list(run_dir.glob("checkpoints/*/COMPLETE")):
                    fault = "reward_crash"  # nothing to resume from yet
                event = {"t": round(now - begin, 1), "fault": fault}
                if fault == "trainer_kill":
                    process.kill()
                elif fault == "second_run":
                    second = subprocess.run(args + ["--resume"], cwd=ROOT, env=env, timeout=120,
                                            capture_output=True, text=True)
                    event["refused"] = second.returncode != 0 and \
                        f"in use by a live run: pid {process.pid}" in second.stderr
                    if process.poll() is not None:  # the first run ended meanwhile: not a test
                        continue
                elif fault == "reward_crash":
                    # the trainer's forkserver is its child; the reward workers are the forkserver's
                    workers = [w for c in children(process.pid) for w in children(c)]
                    if not workers:
                        continue
                    os.kill(rng.choice(workers), signal.SIGKILL)
                else:
                    up = [s for s in servers if s.process.poll() is None
                          and s not in [x for _, x in thawing]]
                    if not up:
                        continue
                    server = rng.choice(up)
                    event["port"] = server.port
                    if fault == "server_kill":
                        server.process.kill()
                        server.process.wait()
                        restarting.append((now + 5, server))
                    else:
                        os.kill(server.process.pid, signal.SIGSTOP)
                        thawing.append((now + 20, server))
                events.append(event)
                print(json.dumps(event), flush=True)
            time.sleep(0.2)  # a supervisor's polling period, not synchronisation of our own work
    finally:
        for s in servers:
            s.stop()
        if process.poll() is None:
            process.kill()
        log.close()
    return {"seconds": time.monotonic() - begin, "faults": events}


def trained_groups(run_dir: Path, steps: int) -> list[int]:
    """Every group trained in steps 1..`steps`, in order: each batch's sample ids, one a group."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if 0 < m["step"] <= steps:
            ids = m["sample_ids"]
            out += [ids[i] for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    return out


def completions(run_dir: Path, steps: int) -> dict[int, list[str]]:
    """Each step's completions (samples.jsonl holds every row: --samples-per-step 16)."""
    out: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        if 0 < s["step"] <= steps:
            out.setdefault(s["step"], []).append(s["completion"])
    return out


def peak(run_dir: Path, key: str) -> float | None:
    values = [m[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if key in (m := json.loads(line))]
    return max(values, default=None)


def weights_gap(a: Path, b: Path, initial: Path) -> tuple[float, float]:
    """(‖a − b‖, ‖b − initial‖) over all weights of two save_pretrained folders."""
    from safetensors.torch import load_file

    wa, wb, w0 = (load_file(p / "model.safetensors") for p in (a, b, initial))
    gap = sum(float((wa[k] - wb[k]).norm() ** 2) for k in w0) ** 0.5
    moved = sum(float((wb[k] - w0[k]).norm() ** 2) for k in w0) ** 0.5
    return gap, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    opts = parser.parse_args()

    from areal_flow.testing.tiny_model import build_tiny_model

    work = Path(os.environ.get("SOAK_WORK", "/tmp/areal_flow_soak"))
    subprocess.run(["rm", "-rf", str(work)], check=True)
    model = build_tiny_model(work / "model")
    data = work / "gsm8k.jsonl"
    data.write_text("".join(
        json.dumps({"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}) + "\n"
        for a in range(8) for b in range(8)))
    faulty, clean = work / "faults", work / "reference"
    faulty.mkdir()
    clean.mkdir()
    load = os.getloadavg()
    soak = run(faulty, model, data, minutes=opts.minutes, steps=1_000_000,
               fault_every=opts.fault_every, seed=opts.seed)
    steps = max(int(p.parent.name[5:])  # the last checkpoint: a SIGTERM may land mid-start
                for p in (faulty / "run" / "checkpoints").glob("step-*/COMPLETE"))
    reference = run(clean, model, data, minutes=None, steps=steps, fault_every=0, seed=0)

    ours, theirs = trained_groups(faulty / "run", steps), trained_groups(clean / "run", steps)
    lost = len([i for i in theirs if i not in ours]) + max(0, len(theirs) - len(ours))
    gap, moved = weights_gap(faulty / "run" / "checkpoints" / f"step-{steps:06d}" / "hf",
                             clean / "run" / "checkpoints" / f"step-{steps:06d}" / "hf", model)
    faults = [e["fault"] for e in soak["faults"]]
    texts, reference_texts = completions(faulty / "run", steps), completions(clean / "run", steps)
    same = [t for t in range(1, steps + 1) if texts.get(t) == reference_texts.get(t)]
    report = {
        "minutes": opts.minutes, "fault_every_s": opts.fault_every, "seed": opts.seed,
        "load_average_at_start": load, "steps": steps, "groups_trained": len(ours),
        "faults": {f: faults.count(f) for f in FAULTS},
        "faults_survived": len(faults),  # the run reached its last step after all of them
        "second_runs_refused": sum(bool(e.get("refused")) for e in soak["faults"]),
        "largest_reward_worker_gb": peak(faulty / "run", "reward_runner/worker_rss_gb"),
        "largest_process_tree_gb": peak(faulty / "run", "memory/tree_rss_gb"),
        "worker_rss_limit_gb": WORKER_RSS_LIMIT_GB,
        "same_groups_in_same_order": ours == theirs,
        "groups_lost_or_added": lost if ours != theirs else 0,
        "epochs_each_prompt_once": all(
            sorted(theirs[i:i + 64]) == list(range(64)) for i in range(0, len(theirs) - 63, 64)),
        "steps_with_the_same_completions": len(same),
        "first_step_with_other_completions": next(
            (t for t in range(1, steps + 1) if t not in same), None),
        "weights_gap": gap, "weights_moved": moved, "weights_gap_ratio": gap / moved,
        "seconds_with_faults": soak["seconds"], "seconds_without": reference["seconds"],
        "wall_time_overhead": soak["seconds"] / reference["seconds"] - 1,
        "events": soak["faults"],
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "events"}, indent=1))


if __name__ == "__main__":
    main()
