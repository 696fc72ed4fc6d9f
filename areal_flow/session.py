"""What every training loop repeats around its stations (run folder, panel, stops, checkpoints):

    with Session(cfg, "gsm8k_sft") as session:     # ranks, run folder, model path
        trainer = TrainEngine(session.model, cfg.train)
        session.resume(trainer)                     # from the newest checkpoint with --resume
        session.show(cfg, columns={"nll": "nll"})   # config.yaml, trackers, the panel
        for step in session.steps():                # ends early after a stop request
            stats = trainer.train(batch, algorithm)  # the recipe's stations
            session.end_step(step, stats)           # log; checkpoint when due; stop when asked
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from areal_flow.live_display import LiveDisplay
from areal_flow.run import RunConfig, RunDir
from areal_flow.stop_request import StopRequest
from areal_flow.runtime.distributed import (any_rank, init_distributed, same_on_all_ranks,
                                            shutdown_distributed)


class Session:
    """A run's scaffolding; `name` (the recipe) heads the panel and names runs/<name>-<time>."""

    def __init__(self, cfg: RunConfig, name: str):
        self.cfg, self.name = cfg, name
        self.rank, self.world, _ = init_distributed()
        self.run = RunDir(same_on_all_ranks(cfg.run_dir or RunDir.default_path(name)),
                          resume=cfg.resume, keep_checkpoints=cfg.keep_checkpoints,
                          lock=self.rank == 0)
        self._closing = contextlib.ExitStack()
        self._closing.callback(shutdown_distributed)
        self._closing.callback(self.run.close)
        dist.barrier()  # every rank has checked the folder before rank 0 writes into it
        self.model: str = same_on_all_ranks(cfg.model or (_packaged_model() if self.rank == 0
                                                          else None))
        """The model's folder or hub id (default: the packaged SmolLM2-135M-Instruct)."""
        self.start = 0
        """The first step to train: 0, or the step of the checkpoint a resume loaded."""
        self.stop = StopRequest()
        self.display: LiveDisplay | None = None
        self.saved_also: Callable[[], Any] = lambda: None
        """What checkpoints keep beside the weights (the rollout's state); `resume` returns it."""
        self._trainer = self._critic = None
        self._stopping = False

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind, error, trace) -> None:
        """Closes the panel, stop handlers, `closing`'s callables, run folder and process group."""
        with self._closing:
            if kind is None and self.display is not None:
                self.display.print(f"done: {self.run.path}")

    def closing(self, close: Callable[[], Any]) -> None:
        """Call `close` as the run ends, before the run folder; last first."""
        self._closing.callback(close)

    def resume(self, trainer: Any, *, critic: Any = None) -> Any:
        """Sets the models to save; --resume loads them, sets `start`, returns `saved_also`'s."""
        self._trainer, self._critic = trainer, critic
        if not self.cfg.resume:
            return None
        self.start, extra = self.run.load_checkpoint(trainer, critic=critic)
        return extra

    def show(self, cfg: Any, *, columns: dict[str, str], note: str = "",
             measured: str = "") -> None:
        """Makes the panel; rank 0 trims logs, prints `note`, writes config.yaml, opens loggers."""
        self.display = LiveDisplay(self.cfg.steps, self.start, enabled=self.rank == 0,
                                   columns=columns)
        if self.rank == 0:
            self.run.truncate_after(self.start)
            self.display.print(f"[bold]{self.name}[/] run folder {self.run.path} · model "
                               f"{self.model} · {self.world} training rank(s)"
                               + (f"\n{note}" if note else ""))
            self.run.write_config(cfg, measured)
            self.run.start_loggers(self.cfg.logger, cfg, self.start)

    def steps(self) -> Iterator[int]:
        """The steps left from `start`; ends after the step at which a stop was requested."""
        self._closing.enter_context(self.stop)
        self._closing.enter_context(self.display)
        yield from itertools.takewhile(lambda _: not self._stopping,
                                       range(self.start, self.cfg.steps))

    def end_step(self, step: int, metrics: dict[str, float] | None = None, *,
                 samples: list[dict] | None = None,
                 failure: BaseException | None = None) -> None:
        """After step `step` (0-based) trained: rank 0 logs and updates the panel; every rank then
        checkpoints when due, on a stop, or on a `failure` on any rank, which is then raised."""
        done = step + 1
        if self.rank == 0 and metrics is not None:
            self.run.log_metrics(done, metrics)
            if samples is not None:
                self.run.log_samples(done, samples)
            self.display.update(done, metrics, samples[0]["completion"] if samples else None)
        stopping = any_rank(self.stop.requested)
        failing = any_rank(failure is not None)  # on every rank: saving is collective
        if done % self.cfg.save_every == 0 or done == self.cfg.steps or stopping or failing:
            try:
                self.checkpoint(done)
            except Exception as error:
                if failing:  # both: why the run ends, and why its step is not kept
                    error.add_note(f"(checkpointing step {done} after: {failure!r})")
                raise
        if failing:
            raise failure or RuntimeError(f"rank 0 failed after step {done}")
        if stopping:
            self._stop(f"after step {done}")

    def stop_before(self, step: int, failure: BaseException | None = None) -> None:
        """Step `step` cannot start: save, raise `failure` or say how to resume; then break."""
        if not self.run.has_checkpoint(step):
            self.checkpoint(step)
        if failure is not None:
            raise failure
        self._stop(f"before step {step + 1}")

    def _stop(self, when: str) -> None:
        """Ends `steps` after this one, saying how to continue."""
        self.display.print(f"stopped {when}; continue with --resume --run-dir {self.run.path}")
        self._stopping = True

    def checkpoint(self, step: int) -> None:
        """Every rank: saves the `resume` models and `saved_also()` as the state after `step`."""
        self.run.save_checkpoint(step, self._trainer, critic=self._critic,
                                 tokenizer_from=self.model, extra=self.saved_also())


def _packaged_model() -> str:
    from areal_flow.data.packaged import packaged_smollm2

    return str(packaged_smollm2())
