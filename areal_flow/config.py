"""Config classes shared by recipes, and loading them from YAML/JSON/dicts.

Every class is a frozen attrs class with validators, so a bad value fails at start-up naming the
field and the allowed range; tyro renders the same classes as a command line (the attribute
docstrings are the help text) and cattrs structures them from files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs
import cattrs
from attrs import validators as v


T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or dict does not fit its class; the message lists every problem."""


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """How episodes are generated and grouped (docs/architecture.md, "Rollout scheduler")."""

    batch_size: int = attrs.field(default=8, validator=v.ge(1))
    """Prompts per training step (B); a batch holds B x group_size episodes."""
    group_size: int = attrs.field(default=4, validator=v.ge(1))
    """Episodes per prompt (G), compared with each other for group-relative advantages."""
    min_group_size: int = attrs.field(default=1, validator=v.ge(1))
    """A group left with fewer episodes (after workflows returned None) is dropped."""
    max_concurrent: int = attrs.field(default=64, validator=v.ge(1))
    """Most episodes in flight at once; a prompt is admitted only when all its G fit."""
    max_staleness: int = attrs.field(default=1, validator=v.ge(0))
    """eta: no trained token may be more than this many versions old; 0 is synchronous."""
    max_prompt_tokens: int = attrs.field(default=1024, validator=v.ge(1))
    """Longer prompts are skipped and counted."""
    max_retries: int = attrs.field(default=2, validator=v.ge(0))
    """Times a sample whose workflow raised is tried again before it is given up."""
    batch_timeout: float = attrs.field(default=900.0, validator=v.gt(0))
    """Seconds the trainer waits for a batch before the run writes a checkpoint and stops with
    an error (no server can serve, every workflow hangs); raise it for very long generations."""
    consume_order: Literal["fifo", "oldest_version"] = attrs.field(
        default="fifo", validator=v.in_(("fifo", "oldest_version")))
    """Which finished groups a batch takes. fifo: in order of finishing — short generations
    finish first, so long ones wait, go stale and are dropped (a length bias; see the
    scheduler's stale_dropped_token_fraction/len_* stats). oldest_version: the groups whose
    oldest token is oldest, i.e. closest to being dropped, so long generations are trained
    before they go stale; the cost is staler trained tokens on average (more off-policy)."""
    filter_flat_groups: int = attrs.field(default=0, validator=v.ge(0))
    """Dynamic sampling (DAPO): drop up to this many flat groups (every reward equal: no
    signal for group-relative advantages) per batch, each replaced by a group of another prompt;
    past the bound flat groups are kept, so a batch always comes. 0: off. The cost is in the
    metrics: rollout/dropped_flat_groups and rollout/dropped_flat_tokens."""

    def __attrs_post_init__(self) -> None:
        if self.filter_flat_groups and self.group_size < 2:
            raise ValueError(f"'filter_flat_groups' needs group_size >= 2: a group of "
                             f"{self.group_size} is always flat")
        if self.min_group_size > self.group_size:
            raise ValueError(
                f"'min_group_size' must be <= group_size ({self.group_size}): {self.min_group_size}"
            )
        if self.max_concurrent < self.group_size:
            raise ValueError(
                f"'max_concurrent' must be >= group_size ({self.group_size}), or no prompt could "
                f"ever be admitted: {self.max_concurrent}"
            )


@attrs.frozen(kw_only=True)
class PolicyLossConfig:
    """The clipped, decoupled policy-gradient loss shared by GRPO and PPO."""

    eps_clip: float = attrs.field(default=0.2, validator=v.gt(0.0))
    """Lower clip range: the ratio is kept above 1 - eps_clip."""
    eps_clip_high: float | None = attrs.field(default=None, validator=v.optional(v.gt(0.0)))
    """Upper clip range (DAPO clip-higher); None uses eps_clip."""
    dual_clip: float | None = attrs.field(default=None, validator=v.optional(v.gt(1.0)))
    """Dual-clip factor c > 1 bounding the loss of negative-advantage tokens; None disables it."""
    importance_weight_cap: float | None = attrs.field(
        default=5.0, validator=v.optional(v.gt(1.0))
    )
    """Cap on the decoupled importance weight pi_prox / pi_behav; None leaves it uncapped."""
    aggregation: Literal["token", "sequence"] = attrs.field(
        default="token", validator=v.in_(("token", "sequence"))
    )
    """Average the loss over all tokens of the batch, or per sequence first."""
    recompute_proximal: bool = True
    """Recompute pi_prox with a forward pass before the update. False saves that forward: tokens
    of the current version take pi_behav (the same weights, as the inference engine computed
    them), stale tokens take pi_theta on the first mini-batch (exact) and a log-linear
    interpolation in versions on later ones (approximate); see F.interpolate_proximal."""
    mismatch_correction: Literal[
        "auto", "none", "tis", "token_mask", "sequence_mask", "geometric_mask"] = attrs.field(
        default="auto",
        validator=v.in_(("auto", "none", "tis", "token_mask", "sequence_mask",
                         "geometric_mask")))
    """Correct the inference engine's logprobs differing from the trainer's at the same weights,
    on the tokens where both are known (sampled by the version being trained; without
    recompute_proximal only on the first mini-batch). tis: there pi_prox := pi_train and the
    behavior weight becomes min(pi_train / pi_rollout, mismatch_cap). token_mask: zero loss for
    a token whose ratio is outside mismatch_band; sequence_mask: for the whole row when any of
    its tokens is; geometric_mask: when the row's geometric-mean ratio is. auto: the recipes
    choose tis when the engine computes in a lower precision than the trainer (bf16 rollouts,
    fp32 training), none otherwise, and config.yaml records the choice
    (`precision.mismatch_default`); a loss that meets auto unresolved applies none. See
    docs/algorithms.md, "Rollout/training mismatch"."""
    mismatch_cap: float = attrs.field(default=2.0, validator=v.gt(1.0))
    """C: tis truncates pi_train / pi_rollout at C; mismatch/outside_cap_fraction counts the
    ratios outside [1/C, C] whatever the correction."""
    mismatch_band: tuple[float, float] = attrs.field(default=(0.5, 2.0))
    """(low, high), 0 < low < 1 < high: the masks drop ratios pi_train / pi_rollout outside it."""

    @mismatch_band.validator
    def _check_band(self, attribute: attrs.Attribute, value: tuple[float, float]) -> None:
        if len(value) != 2 or not 0 < value[0] < 1 < value[1]:
            raise ValueError(f"'mismatch_band' must be (low, high) with 0 < low < 1 < high: "
                             f"{value!r}")


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """AdamW with warmup and gradient clipping."""

    lr: float = attrs.field(default=1e-6, validator=v.gt(0.0))
    """Peak learning rate."""
    weight_decay: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """Decoupled weight decay."""
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.999), validator=v.deep_iterable(v.and_(v.ge(0.0), v.lt(1.0)))
    )
    """AdamW betas, each in [0, 1)."""
    warmup_steps: int = attrs.field(default=0, validator=v.ge(0))
    """Steps of linear warmup from 0 to lr."""
    max_grad_norm: float = attrs.field(default=1.0, validator=v.gt(0.0))
    """Gradients are clipped to this global norm; a non-finite norm skips the step."""


_converter = cattrs.Converter(forbid_extra_keys=True)


@attrs.frozen(kw_only=True)
class InferenceConfig:
    """Where rollouts are generated: the in-process local engine, or SGLang(-protocol) servers."""

    backend: str = "local"
    """A registered generation pool: local (in-process engine) or sglang (HTTP servers)."""
    dtype: Literal["auto", "float32", "bfloat16"] = attrs.field(
        default="auto", validator=v.in_(("auto", "float32", "bfloat16")))
    """Local engine (and launched servers') weights' dtype; auto measures which decodes faster
    here for this model's shapes (bf16 on a GPU; `runtime/precision.py`). In the trainer's
    dtype (fp32 without FSDP) it shares the trainer's weights."""
    max_batch_size: int = attrs.field(default=64, validator=v.ge(1))
    """Most sequences the local engine decodes at once."""
    threads: int | None = attrs.field(default=None, validator=v.optional(v.ge(1)))
    """CPU threads the in-process local engine computes with, in a pool of its own (the trainer
    keeps the process's). None: as many as the process's (measured fastest for SmolLM2 on 2
    cores; 1 was faster for the tiny model, benchmarks/README.md)."""
    hosted: bool = True
    """The in-process local engine decodes on the trainer's thread while the trainer waits for
    its batch (`LocalEngine.hosted`; off: on the engine thread throughout, for comparisons)."""
    decode_while_training: bool = False
    """The in-process local engine goes on decoding (at max_staleness >= 1: the next batch)
    while the trainer trains. Off, it makes no step until the trainer waits again: the engine
    and the trainer compute on the same cores, and beside the engine's thread training took
    2-2.4x longer on 2 cores (tiny model 14 -> 35 ms; GIL and OpenMP teams), more than the
    overlap saved (benchmarks/README.md, "Generation beside training")."""
    device: str = attrs.field(default="auto")
    """Where the local engine (and launched `areal-flow serve` servers) run: auto (cuda when a
    GPU is visible, else cpu), cpu, cuda or cuda:N."""
    deterministic: bool = False
    """Launch SGLang with --enable-deterministic-inference. Without it SGLang ignores per-request
    sampling seeds (slower: batch-invariant kernels, pytorch sampling); our server always
    honours them."""
    addresses: tuple[str, ...] = ()
    """Running servers (host:port) for the sglang backend; none given launches `servers`."""
    addresses_file: str | None = None
    """A file of server addresses, one per line, re-read while training (servers join/leave)."""
    server_gpus: tuple[int, ...] = (0,)
    """GPUs for servers launched when no addresses are given: one server per tp_size of them
    (keep them apart from the training ranks' GPUs)."""
    tp_size: int = attrs.field(default=1, validator=v.ge(1))
    """Tensor-parallel GPUs per launched SGLang server."""
    server_program: Literal["sglang", "areal-flow"] = attrs.field(
        default="sglang", validator=v.in_(("sglang", "areal-flow")))
    """What launched servers run: SGLang (GPUs), or `areal-flow serve` (our SGLang-protocol
    server over the local engine, for CPU machines and tests)."""
    request_timeout: float = attrs.field(default=3600.0, validator=v.gt(0))
    """sglang: seconds one /generate call may take before its server is taken out of rotation
    (the request then continues on another)."""
    control_timeout: float = attrs.field(default=600.0, validator=v.gt(0))
    """sglang: seconds a weight load or a weight-update group call may take."""
    pause_timeout: float = attrs.field(default=30.0, validator=v.gt(0))
    """sglang: seconds a pause/resume call may take; a frozen server is taken out of rotation
    after this instead of holding up every weight update."""
    no_server_timeout: float = attrs.field(default=600.0, validator=v.gt(0))
    """sglang: seconds a request waits for a server in rotation before it fails."""
    startup_timeout: float = attrs.field(default=120.0, validator=v.ge(0))
    """sglang, servers given by address: seconds the run waits at start for one of them to
    answer /health (servers started with the run are still loading), saying so every 10 s."""
    health_timeout: float = attrs.field(default=30.0, validator=v.gt(0))
    """sglang: seconds a /health check may take (SGLang's takes ~1 s; more while paused, when
    none is made); a server holding requests is checked every second, so one that froze is
    taken out, and its requests continue elsewhere, after about this long."""
    lease_dir: str | None = None
    """sglang: where runs lease their servers, so that two runs never write weights into one
    server (`launch/lease.py`): a folder every run reaches (like the weight folders). None:
    $XDG_CACHE_HOME/areal_flow/leases (~/.cache)."""

    @device.validator
    def _check_device(self, attribute: attrs.Attribute, value: str) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"'device' must be auto, cpu, cuda or cuda:N: {value!r}")


def _describe(exc: BaseException, type_: Any) -> str:
    # cattrs' generic wording drops the validator's message, which names the allowed range.
    generic = cattrs.v.format_exception(exc, type_)
    vague = generic == "invalid value" or generic.startswith("unknown error")
    return str(exc) if vague and str(exc) else generic


def structure(cls: type[T], data: dict[str, Any]) -> T:
    """Build `cls` from plain data, reporting every bad or unknown field by its path."""
    try:
        return _converter.structure(data, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        problems = (
            cattrs.transform_error(exc, path=cls.__name__, format_exception=_describe)
            if isinstance(exc, cattrs.BaseValidationError)
            else [str(exc)]
        )
        raise ConfigError(
            f"invalid {cls.__name__}:\n" + "\n".join(f"  - {p}" for p in problems)
        ) from None


def load(cls: type[T], path: str | Path) -> T:
    """Read a YAML or JSON file into `cls` (JSON is YAML, so one parser reads both)."""
    import yaml

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    return structure(cls, data)


def unstructure(config: Any) -> dict[str, Any]:
    return _converter.unstructure(config)


def dump(config: Any, path: str | Path) -> None:
    """Save a config as JSON (a .json path) or YAML (any other), readable back with `load`."""
    import yaml

    data = unstructure(config)
    text = json.dumps(data, indent=2) + "\n" if Path(path).suffix == ".json" else \
        yaml.safe_dump(data, sort_keys=False)
    Path(path).write_text(text)
