"""What the RL recipes (gsm8k_grpo, gsm8k_ppo, reasoning_gym_grpo) share: config and loop parts."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import attrs
import torch
import torch.distributed as dist
import tyro
import yaml
from attrs import validators as v

from areal_flow import registry
from areal_flow.config import (InferenceConfig, OptimizerConfig, RolloutConfig, load,
                               structure)
from areal_flow.algorithms.functional import flat_groups
from areal_flow.algorithms.grpo import GRPOConfig
from areal_flow.data import offline
from areal_flow.inference.local import LocalEngine
from areal_flow.rollout.scheduler import RolloutError, RolloutScheduler
from areal_flow.process_memory import peak_rss_gb, tree_rss_gb
from areal_flow.run import RunConfig
from areal_flow.stop_request import StopRequest
from areal_flow.runtime import compiled_layers
from areal_flow.runtime.distributed import same_on_all_ranks
from areal_flow.runtime.engine import TrainConfig
from areal_flow.types import AlgorithmCapabilities, SamplingParams
from areal_flow.workflow.rlvr import RLVRConfig

C = TypeVar("C", bound="RLConfig")

PROMPT = ("Answer the question. Show short reasoning, then the final number after '####'.\n\n"
          "Example question: Tom has 3 apples and buys 2 more. How many apples does he have?\n"
          "Example answer: 3 + 2 = 5. #### 5\n\nQuestion: {question}\nAnswer:")
"""A one-shot prompt: SmolLM2-135M then writes '#### N' in about 1 completion of 6."""
DEFAULT_REWARD_KWARGS = {"require_work": True, "format_weight": 0.1}
"""The gsm8k reward of the default run: 1 for the right number after a shown calculation, 0.1 for
a wrong one in the '#### N' form after one. Without the 0.1, 21 of 24 steps had only flat groups
(reward 0) and trained nothing; with it 22-23 of 24 trained (benchmarks/README.md)."""
AllocationOption = Annotated[str | None, tyro.conf.arg(
    metavar="'generation: S servers [x tp T], training: R ranks [on ...]'")]
"""Kept as text: its grammar (`launch/allocation.py`) is loaded only when a run gives one."""


@attrs.frozen(kw_only=True)
class RLConfig(RunConfig):
    """An RL run; `algorithm` is of the config class that `algorithm_name` declares."""

    algorithm_name: Annotated[str, tyro.conf.arg(name="algorithm")] = "grpo"
    """A registered algorithm or 'module:Class'; its --algorithm.<field> options follow it."""
    algorithm: GRPOConfig = GRPOConfig()
    """The algorithm's options: an instance of the config class `algorithm_name` declares."""
    workflow: str = "rlvr"
    """A registered workflow (see `areal-flow plugins`)."""
    workflow_config: str | None = None
    """The workflow's config, a YAML/JSON file or inline JSON; rlvr's default: the gsm8k reward."""
    reward: str | None = None
    """A registered reward: sets the `reward` field of the workflow's config."""
    reward_failure_limit: float = attrs.field(default=0.5, validator=[v.ge(0.0), v.le(1.0)])
    """Stop when rewards fail on more than this fraction of their last 64 calls (1: never)."""
    reward_worker_max_calls: int = attrs.field(default=1000, validator=v.ge(0))
    """A reward worker process is replaced after this many calls (0: never)."""
    reward_worker_max_rss_gb: float = attrs.field(default=2.0, validator=v.ge(0.0))
    """Replace a reward worker holding more than this memory after a call (0: never)."""
    eval_size: int = attrs.field(default=64, validator=v.ge(0))
    """Held-out rows evaluated greedily every `eval_every` steps (64: 95% CI +-6 points at 5%)."""
    samples_per_step: int = attrs.field(default=2, validator=v.ge(0))
    """Episodes written to samples.jsonl per step: prompt, completion, reward, every segment."""
    rollout: RolloutConfig = RolloutConfig(batch_size=2, group_size=8, max_staleness=1,
                                           max_concurrent=32)
    sampling: SamplingParams = SamplingParams(max_new_tokens=128, temperature=1.0)
    # packs of up to 4,096 tokens, each row attending on its own, the MLPs and norms compiled
    # where a C++ compiler is: 1.27x a bf16 SmolLM2 step of 512-token packs through the mask,
    # for +0.63 GB at its peak (benchmarks/train_step.py)
    train: TrainConfig = TrainConfig(optim=OptimizerConfig(lr=2e-5), max_tokens_per_mb=4096,
                                     packed_attention=True, compile="auto", dtype="auto")
    inference: InferenceConfig = InferenceConfig()
    allocation: AllocationOption = attrs.field(default=None,
                                               converter=attrs.converters.optional(str))
    """Where everything runs: 'generation: 2 servers x tp 2, training: 4 ranks' (ranks on the
    first GPUs), '... on 3 nodes x 8 gpus', '... on cpu'; sets --inference.backend/tp-size/..."""
    dry_run: bool = False
    """Print where each process would run and how to start them, then exit before loading."""
    critic: TrainConfig = TrainConfig(optim=OptimizerConfig(lr=5e-5), max_tokens_per_mb=4096,
                                      packed_attention=True, compile="auto", dtype="auto")
    """The critic's training settings (ppo: a value head on the policy's backbone); it steps once
    per policy mini-batch, so its ppo-minibatches is not an option."""
    teacher: str | None = None
    """The frozen teacher (folder or Hub name) for distill; it must share --model's tokenizer."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.allocation is not None:  # the one source of where generation runs
            from areal_flow.launch.allocation import Allocation

            allocation = Allocation.parse(self.allocation)
            default = attrs.fields(type(self)).inference.default
            # frozen: set once, while being built
            object.__setattr__(self, "allocation", str(allocation))
            object.__setattr__(self, "inference", allocation.apply(self.inference,
                                                                   default=default))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        for option, train in (("--train.compile", self.train), ("--critic.compile", self.critic)):
            compiled_layers.wanted(train.compile, device, option)  # "on" with no compiler
        spec = registry.algorithms.spec(self.algorithm_name)  # an unknown name fails here
        if spec.config is not None and not isinstance(self.algorithm, spec.config):
            raise ValueError(f"--algorithm {self.algorithm_name} takes a {spec.config.__name__} "
                             f"as its options, not a {type(self.algorithm).__name__}: build the "
                             "config with `rl_recipes.cli` (the recipes do), or pass "
                             f"algorithm={spec.config.__name__}(...)")
        if self.critic.ppo_minibatches != 1:  # the critic's steps follow the policy's
            raise ValueError(
                f"--critic.ppo-minibatches {self.critic.ppo_minibatches}: the critic takes one "
                "step per policy mini-batch, so its mini-batches are --train.ppo-minibatches; "
                "drop --critic.ppo-minibatches")
        if self.train.ppo_minibatches > self.rollout.batch_size:
            raise ValueError(
                f"--train.ppo-minibatches {self.train.ppo_minibatches} is more than the "
                f"{self.rollout.batch_size} groups of a batch (--rollout.batch-size): a group is "
                "never split, so some mini-batches would be empty")


def cli(config_class: type[C], args: Sequence[str] | None = None) -> C:
    """The recipe's config via `tyro.cli`; `--algorithm NAME` picks the `algorithm` field type."""
    args = list(sys.argv[1:] if args is None else args)
    if any(arg.split("=", 1)[0] == "--allocation" for arg in args):
        from areal_flow.launch.allocation import AllocationError, refuse_replaced_flags

        try:
            refuse_replaced_flags(args)
        except AllocationError as error:
            usage_error(error)
    name = _flag(args, "--algorithm")
    if name not in (None, attrs.fields_dict(config_class)["algorithm_name"].default):
        try:
            options = registry.algorithms.spec(name).config
        except registry.RegistryError as error:
            usage_error(f"--algorithm {name}: {error}")
        described = Annotated[options, tyro.conf.arg(
            help=f"Options of algorithm {name} ({getattr(options, '__name__', 'none')}).")]
        namespace = {"__annotations__": {"algorithm": described},
                     "algorithm": options() if options is not None else None,
                     "__module__": config_class.__module__, "__doc__": config_class.__doc__,
                     "__qualname__": config_class.__qualname__}
        config_class = attrs.frozen(kw_only=True)(
            type(config_class.__name__, (config_class,), namespace))
    workflow = _flag(args, "--workflow")
    try:
        return tyro.cli(config_class, args=args)
    finally:  # --workflow NAME --help: after the recipe's options (tyro exits), the workflow's
        if workflow is not None and {"-h", "--help"} & set(args):
            try:
                registry.show_options(registry.workflows, workflow)
            except registry.RegistryError as error:
                print(f"--workflow {workflow}: {error}", file=sys.stderr)


def _flag(args: list[str], flag: str) -> str | None:
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def usage_error(error: Exception | str) -> NoReturn:
    """Exit 2, as tyro does for a bad option, with the message alone (no traceback)."""
    if int(os.environ.get("RANK", 0)) == 0:  # not once per torchrun rank
        print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)


def checked(cfg: RLConfig) -> tuple[Any, Any]:
    """The workflow's config and the algorithm, before any work; bad input exits 2."""
    try:
        return workflow_config(cfg), algorithm(cfg)
    except (ValueError, OSError, registry.RegistryError) as error:
        usage_error(error)


def algorithm(cfg: RLConfig) -> Any:
    """The algorithm `cfg` names, built from its options and checked against the rollout."""
    algo = registry.algorithms.get(cfg.algorithm_name)
    built = algo(cfg.algorithm) if registry.algorithms.spec(cfg.algorithm_name).config else algo()
    needs = AlgorithmCapabilities.of(built).min_group_size
    if cfg.rollout.group_size < needs:
        raise ValueError(f"--rollout.group-size {cfg.rollout.group_size}: {cfg.algorithm_name} "
                         f"scores a row against the rest of its group, so it needs groups of "
                         f"{needs} or more")
    if ("teacher" in built.roles) != (cfg.teacher is not None):
        raise ValueError(
            f"--algorithm {cfg.algorithm_name} learns from a teacher model: pass --teacher PATH "
            "(a model of the same tokenizer as --model)" if cfg.teacher is None else
            f"--teacher {cfg.teacher}: algorithm {cfg.algorithm_name} has no teacher role, so "
            "the teacher would never be used: drop --teacher")
    return built


def run_name(cfg: RLConfig) -> str:
    """`<task>_<algorithm>`, the run folder's name; task: the workflow, or for rlvr the dataset."""
    if cfg.workflow != "rlvr":
        task = cfg.workflow
    elif cfg.dataset is None:
        task = "gsm8k"
    elif (source := offline.source(cfg.dataset)) is not None:
        task = source.task(cfg.dataset)
    else:
        task = Path(cfg.dataset.split(":", 1)[0]).stem
    return re.sub(r"[^\w.-]+", "_", f"{task}_{cfg.algorithm_name}")


def load_data(cfg: RLConfig, model: str, rank: int,
              workflow_options: Any = None) -> tuple[list[dict], list[dict], str]:
    """Rank 0's (train rows, eval rows, source line), checked before any weights load; other ranks
    get empty rows. An error fails every rank; rank 0 exits 2 on a bad input (ValueError, ...)."""
    rows, error = ([], [], ""), None
    if rank == 0:
        try:
            check_model(cfg, model)
            if cfg.teacher is not None:
                from areal_flow.extra_algorithms.distill import check_teacher

                check_teacher(cfg.teacher, model)
            rows = offline.train_eval_rows(cfg.dataset, cfg.eval_size)
            check_fields(cfg.dataset, workflow_options, {"train": rows[0], "eval": rows[1]})
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
    message = same_on_all_ranks(None if error is None else f"{type(error).__name__}: {error}")
    if isinstance(error, (ValueError, OSError, ImportError)):
        usage_error(error)  # the user's input: one line, no traceback
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"rank 0 stopped before training: {message}")
    return rows


def check_fields(dataset: str, options: Any, splits: dict[str, list[dict]]) -> None:
    """Each row holds every field a ``*_field`` workflow option names (before weights load)."""
    if not attrs.has(type(options)):
        return
    names = {option: name for option, name in attrs.asdict(options, recurse=False).items()
             if option.endswith("_field") and isinstance(name, str)}
    for split, rows in splits.items():
        for (i, row), (option, name) in itertools.product(enumerate(rows), names.items()):
            if not isinstance(row, dict) or name not in row:
                has = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
                raise ValueError(
                    f"--dataset {dataset}: {split} row {i} has no field {name!r} (it has: {has}), "
                    f"which the workflow's {option} names; name the row's field with "
                    f"--workflow-config '{{\"{option}\": \"...\"}}'")


def check_model(cfg: RLConfig, model: str) -> None:
    """--model names a model whose config loads, with room for --sampling.max-new-tokens."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        where = "no such folder" if Path(model).anchor or model.startswith(".") else \
            "not a model folder here, nor a model on the Hugging Face Hub"
        raise ValueError(f"--model {model}: {where} ({error})") from None
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and cfg.sampling.max_new_tokens >= positions:
        raise ValueError(f"--sampling.max-new-tokens {cfg.sampling.max_new_tokens} leaves no "
                         f"room for a prompt in the model's {positions} positions")


def workflow_config(cfg: RLConfig) -> Any:
    """The workflow's config from --workflow-config / --reward (names checked now)."""
    spec = registry.workflows.spec(cfg.workflow)
    if spec.config is None:
        if cfg.workflow_config or cfg.reward:
            raise ValueError(f"workflow {cfg.workflow!r} takes no config: drop --workflow-config "
                             "and --reward")
        return None
    if cfg.workflow_config is None and spec.config is RLVRConfig:
        source = offline.source(cfg.dataset)  # e.g. reasoning_gym: its reward and prompt
        config = RLVRConfig(reward=source.reward, prompt_template=source.prompt_template) \
            if source is not None else \
            RLVRConfig(prompt_template=PROMPT, reward_kwargs=dict(DEFAULT_REWARD_KWARGS))
    elif cfg.workflow_config is None:
        config = spec.config()
    elif cfg.workflow_config.lstrip().startswith("{"):
        try:
            data = json.loads(cfg.workflow_config)
        except ValueError as error:
            raise ValueError(f"--workflow-config: not valid JSON ({error})") from None
        config = structure(spec.config, data)
    else:
        if not Path(cfg.workflow_config).is_file():
            raise FileNotFoundError(f"--workflow-config {cfg.workflow_config}: no such file (or "
                                    "pass the config inline as a JSON object)")
        try:
            config = load(spec.config, cfg.workflow_config)
        except yaml.YAMLError as error:
            raise ValueError(f"--workflow-config {cfg.workflow_config}: not valid YAML/JSON "
                             f"({error})") from None
    if cfg.reward is not None:
        if "reward" not in attrs.fields_dict(type(config)):
            fields = ", ".join(attrs.fields_dict(type(config))) or "none"
            raise ValueError(
                f"--reward sets the 'reward' field of the workflow's config, and workflow "
                f"{cfg.workflow!r}'s config ({type(config).__name__}) has none (its fields: "
                f"{fields}): drop --reward, or declare `reward: str` in that config class")
        registry.rewards.get(cfg.reward)  # an unknown name fails now, with suggestions
        config = attrs.evolve(config, reward=cfg.reward)
    return config


def panel_columns(cfg: RLConfig, *, critic: bool, teacher: bool) -> dict[str, str]:
    """The live panel's columns of an RL run (`LiveDisplay`): metric key -> label."""
    # |log pi_train - log pi_rollout|: shown where a correction acts on it (a plugin's
    # algorithm may have no policy loss config)
    corrected = getattr(getattr(cfg.algorithm, "loss", None), "mismatch_correction",
                        "none") != "none"
    return {"reward/mean": "reward", "task_metrics": "",  # the task's own, e.g. accuracy
            "reward/flat_group_fraction": "flat groups", "response_length/mean": "length",
            "entropy": "entropy",
            **({"entropy_coef": "entropy coef"}  # adaptive entropy control's coefficient
               if getattr(cfg.algorithm, "entropy_target", None) is not None else {}),
            # dynamic sampling: the flat groups drawn and dropped for this step's batch
            **({"rollout/batch_dropped_flat_groups": "dropped flat"}
               if cfg.rollout.filter_flat_groups else {}),
            **({"critic/value_loss": "value loss"} if critic else {}),
            **({"distill/reverse_kl": "reverse KL"} if teacher else {}),
            **({"mismatch/abs_log_ratio_mean": "mismatch"} if corrected else {}),
            "eval/reward": "eval reward", "eval/task_metrics": "eval ",
            "reward_runner/failure_rate": "reward fails", "tokens_per_second": "tok/s",
            "perf/mfu": "MFU", "perf/decode_mbu": "decode MBU",
            "staleness/mean": "staleness", "seconds/step": "s/step"}


@attrs.define
class EntropyWatch:
    """Warns once when `entropy` falls below `fraction` of its first reading (a collapse)."""

    fraction: float = 0.2
    first: float | None = None
    warned: bool = False

    def check(self, metrics: dict[str, Any]) -> str | None:
        """The warning, the first time this step's entropy is below the bound; else None."""
        entropy = metrics.get("entropy")
        if entropy is None or not math.isfinite(entropy):  # a step that trained no row
            return None
        if self.first is None:
            self.first = entropy
        elif not self.warned and entropy < self.fraction * self.first:
            self.warned = True
            return (f"warning: entropy {entropy:.3g} nats, below {self.fraction:.0%} of its "
                    f"first {self.first:.3g}: the policy is collapsing onto one form of answer. "
                    "Try --algorithm.entropy-target 1.2 --algorithm.entropy-coef-step 0.1 "
                    "(GRPO), --train.optim.warmup-steps 10 or a lower --train.optim.lr "
                    "(docs/when_a_run_does_not_learn.md)")
        return None


@attrs.frozen
class BatchWait:
    """What `next_batch` gave: rank 0's batch, or why not; `halted` is the same on all ranks."""

    batch: Any = None
    """Rank 0's batch (a TensorDict; `train` scatters it); None on other ranks."""
    stopped: bool = False
    failure: BaseException | None = None
    """Why no batch came: rank 0's rollout error; on other ranks a RuntimeError naming it."""

    @property
    def halted(self) -> bool:
        return self.stopped or self.failure is not None


HOST_WAIT = 0.002
"""Seconds a hosting thread waits for work between batch checks (0.01: 37 ms steps, not 30)."""


def hosting(pool: Any, host: bool = True) -> contextlib.AbstractContextManager:
    """The engine for this thread to step (its own thread's OpenMP team is throttled), or None."""
    return pool.hosted() if host and isinstance(pool, LocalEngine) else contextlib.nullcontext()


def next_batch(scheduler: RolloutScheduler | None, stop: StopRequest, timeout: float,
               host: bool = True) -> BatchWait:
    """Every rank: rank 0's next batch (other ranks pass no scheduler), or why there is none,
    the same on all ranks: a stop request, or the rollout's error (RolloutError at `timeout`)."""
    wait = _wait_for_batch(scheduler, stop, timeout, host) if scheduler is not None \
        else BatchWait()
    if not dist.is_initialized():
        return wait
    why = same_on_all_ranks("stopped" if wait.stopped else None if wait.failure is None
                            else f"{type(wait.failure).__name__}: {wait.failure}")
    if scheduler is not None or why is None:
        return wait
    return BatchWait(stopped=True) if why == "stopped" else \
        BatchWait(failure=RuntimeError(f"rank 0's rollout: {why}"))


def _wait_for_batch(scheduler: RolloutScheduler, stop: StopRequest, timeout: float,
                    host: bool) -> BatchWait:
    deadline = time.monotonic() + timeout
    with hosting(scheduler.pool, host) as engine:
        while not stop.requested:  # wait in short slices, so a stop request is seen within one
            try:
                return BatchWait(batch=scheduler.prepare_batch(timeout=0.0 if engine else min(
                    1.0, max(deadline - time.monotonic(), 0))))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    return BatchWait(failure=RolloutError(
                        f"no batch in {timeout:g} s (--rollout.batch-timeout): no server could "
                        f"serve, or every workflow hung; the rollout's counters: "
                        f"{scheduler.stats()}"))
                if engine:
                    engine.step(timeout=HOST_WAIT)  # or wait that long for requests to come
            except Exception as error:  # noqa: BLE001 - raised by the recipe, after a checkpoint
                return BatchWait(failure=error)
    return BatchWait(stopped=True)


def evaluate(cfg: RLConfig, scheduler: RolloutScheduler, rows: list[dict], *,
             run: Any = None, step: int = 0) -> dict[str, float]:
    """Greedy pass@1 on `rows`: eval/<metric> (Wilson intervals for rates); with `run` (a
    `RunDir`), each row's episode goes to eval_samples.jsonl under `step`."""
    if not rows:
        return {}
    greedy = attrs.evolve(cfg.sampling, temperature=0.0)
    # the rollout waits on a helper thread, so that this one can run the engine's steps
    with hosting(scheduler.pool, cfg.inference.hosted) as engine, \
            concurrent.futures.ThreadPoolExecutor(1) as helper:
        pending = helper.submit(scheduler.rollout_batch, rows, sampling=greedy)
        while engine and not pending.done():
            engine.step(timeout=HOST_WAIT)
        groups = pending.result()
        episodes = [ep for group in groups for ep in group]
    if run is not None:  # a row whose episode kept failing: no transcript, reward 0
        run.log_eval_samples(step, [
            {"index": i, "row": row, "transcript": None, "reward": 0.0, "metrics": {}} if not group
            else {"index": i, "row": row, "transcript": transcript(group[0], scheduler.tokenizer),
                  "reward": float(group[0].reward or 0.0), "metrics": dict(group[0].metrics)}
            for i, (row, group) in enumerate(zip(rows, groups))])
    n = len(rows)  # a row whose episode kept failing counts as a 0
    out = {"eval/reward": sum(ep.reward for ep in episodes) / n,
           "eval/response_length": sum(sum(ep.loss_mask) for ep in episodes) / n}
    rates = {name for ep in episodes for name in ep.rates}
    for name, (mean, interval) in metric_means([ep.metrics for ep in episodes], n,
                                               rates).items():
        out[f"eval/{name}"] = mean
        if interval is not None:
            out.update({f"eval/{name}_ci_low": interval[0], f"eval/{name}_ci_high": interval[1]})
    return out


def transcript(episode: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """The episode's segments after its prompt, as the model saw them, each marked ``"model"``."""
    return [{"model": seg.trainable, "text": tokenizer.decode(list(seg.token_ids))}
            for seg in itertools.dropwhile(lambda seg: not seg.trainable, episode.segments)]


def metric_means(metrics: list[dict[str, float]], n: int, rates: set[str]
                 ) -> dict[str, tuple[float, tuple[float, float] | None]]:
    """Each task metric's mean over `n` rows (missing: 0), with a Wilson interval for `rates`."""
    out = {}
    for name in sorted({name for row in metrics for name in row}):
        total = sum(float(row.get(name, 0.0)) for row in metrics)
        out[name] = (total / n, wilson_interval(round(total), n) if name in rates else None)
    return out


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval (95% at default z): in [0, 1], not empty at 0 or n hits."""
    if n <= 0:
        raise ValueError(f"wilson_interval needs n >= 1 trials: {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def batch_metrics(cfg: RLConfig, batch, scheduler: RolloutScheduler) -> dict[str, Any]:
    """Reward, the task's metrics, response length and staleness of a trained batch."""
    rewards = batch["rewards"].float()
    lengths = batch["loss_mask"].sum(-1).float()
    flat = flat_groups(rewards, batch["group_ids"])
    groups = torch.unique(batch["group_ids"])
    out = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
           # groups whose rewards are all equal: no advantage, nothing to learn from
           "reward/flat_group_fraction": torch.isin(groups, batch["group_ids"][flat]).float()
           .mean().item(),
           "response_length/mean": lengths.mean().item(),
           "response_length/max": lengths.max().item(),
           # completions cut off by max_new_tokens: their reward judges an unfinished answer
           "response_length/clip_fraction":
               (lengths >= cfg.sampling.max_new_tokens).float().mean().item()}
    for name, values in batch["metrics"].items():  # the task's numbers (Episode.metrics)
        reported = values[~values.isnan()]
        if reported.numel():
            out[name] = reported.mean().item()
    out["task_metrics"] = sorted(batch["metrics"].keys())  # the panel shows these
    out["sample_ids"] = sorted(set(batch["sample_ids"].tolist()))  # for exact-resume checks
    out["memory/peak_rss_gb"] = peak_rss_gb()
    out["memory/tree_rss_gb"] = tree_rss_gb()  # and the reward workers, servers it launched
    if torch.cuda.is_available():  # this rank's device: weights, optimizer, engine, activations
        out["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
    lags = (batch["policy_version"][:, None] - batch["versions"])[batch["loss_mask"]]
    out["staleness/mean"] = lags.float().mean().item()
    out["staleness/max"] = lags.max().item() if lags.numel() else 0
    return out


def memory_parts(trainer: Any, pool: Any) -> dict[str, float]:
    """memory/<part>_gb: this rank's weights, gradients, optimizer state, in-process engine
    (its weights; `kv_cache`: the KV cache of the rows it holds between steps)."""
    out = {f"memory/{part}_gb": gb for part, gb in trainer.memory_gb().items()}
    if isinstance(pool, LocalEngine):
        out["memory/engine_gb"] = pool.memory_gb()
        out["memory/kv_cache_gb"] = pool.kv_cache_gb()
    return out


def component_stats(**components: Any) -> dict[str, float]:
    return {f"{name}/{key}": float(value) for name, component in components.items()
            for key, value in component.stats().items()}


def samples(cfg: RLConfig, batch, scheduler: RolloutScheduler) -> list[dict[str, Any]]:
    """First `samples_per_step` episodes: prompt, completion, reward, segments, metrics, info."""
    shown = min(cfg.samples_per_step, batch.batch_size[0])
    tok = scheduler.tokenizer
    infos = batch["info"]  # tensordict gives non-tensor entries as a list or a NonTensorStack
    infos = list(infos.tolist() if hasattr(infos, "tolist") else infos)
    out = []
    for i in range(shown):
        ids, mask = batch["input_ids"][i], batch["loss_mask"][i]
        k = int(batch["attention_mask"][i].sum())
        tokens = zip(ids[:k].tolist(), mask[:k].tolist())
        segments = [{"text": tok.decode([t for t, _ in run]), "trained": trained}
                    for trained, run in itertools.groupby(tokens, key=lambda pair: pair[1])]
        out.append({"prompt": "" if segments[0]["trained"] else segments[0]["text"],
                    "completion": tok.decode(ids[mask], skip_special_tokens=True),
                    "reward": batch["rewards"][i].item(), "segments": segments,
                    "metrics": {name: value[i].item() for name, value in batch["metrics"].items()
                                if not value[i].isnan()},
                    "info": infos[i]})
    return out
