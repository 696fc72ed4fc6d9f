"""Config classes shared by recipes: frozen, validated attrs classes that tyro and cattrs build."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import attrs
import cattrs
from attrs import validators as v


T = TypeVar("T")

MismatchCorrection = Literal["auto", "none", "tis", "token_mask", "sequence_mask", "geometric_mask"]


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
    """Seconds to wait for a batch before the run checkpoints and stops with an error."""
    consume_order: Literal["fifo", "oldest_version"] = attrs.field(
        default="fifo", validator=v.in_(("fifo", "oldest_version")))
    """Which finished groups a batch takes: fifo (long ones go stale) or oldest_version."""
    filter_flat_groups: int = attrs.field(default=0, validator=v.ge(0))
    """Dynamic sampling (DAPO): flat groups dropped per batch, at most (then kept); 0: off."""

    def __attrs_post_init__(self) -> None:
        if self.filter_flat_groups and self.group_size < 2:
            raise ValueError(f"'filter_flat_groups' needs group_size >= 2: a group of "
                             f"{self.group_size} is always flat")
        if self.min_group_size > self.group_size:
            raise ValueError(f"'min_group_size' must be <= group_size ({self.group_size}): "
                             f"{self.min_group_size}")
        if self.max_concurrent < self.group_size:
            raise ValueError(f"'max_concurrent' must be >= group_size ({self.group_size}), or no "
                             f"prompt could ever be admitted: {self.max_concurrent}")


@attrs.frozen(kw_only=True)
class PolicyLossConfig:
    """The clipped, decoupled policy-gradient loss shared by GRPO and PPO."""

    eps_clip: float = attrs.field(default=0.2, validator=v.gt(0.0))
    """Lower clip range: the ratio is kept above 1 - eps_clip."""
    eps_clip_high: float | None = attrs.field(default=None, validator=v.optional(v.gt(0.0)))
    """Upper clip range (DAPO clip-higher); None uses eps_clip."""
    dual_clip: float | None = attrs.field(default=None, validator=v.optional(v.gt(1.0)))
    """Dual-clip factor c > 1 bounding the loss of negative-advantage tokens; None disables it."""
    importance_weight_cap: float | None = attrs.field(default=5.0,
                                                      validator=v.optional(v.gt(1.0)))
    """Cap on the decoupled importance weight pi_prox / pi_behav; None leaves it uncapped."""
    aggregation: Literal["token", "sequence"] = attrs.field(
        default="token", validator=v.in_(("token", "sequence")))
    """Average the loss over all tokens of the batch, or per sequence first."""
    recompute_proximal: bool = True
    """Recompute pi_prox by a forward pass; False approximates it (F.interpolate_proximal)."""
    mismatch_correction: MismatchCorrection = attrs.field(
        default="auto", validator=v.in_(get_args(MismatchCorrection)))
    """Correct the engine's logprobs differing from the trainer's: tis (weight min(pi_train /
    pi_rollout, mismatch_cap)), token_/sequence_/geometric_mask (zero loss outside mismatch_band),
    none, or auto (tis when rollouts are in lower precision than training; docs/algorithms.md)."""
    mismatch_cap: float = attrs.field(default=2.0, validator=v.gt(1.0))
    """C: tis truncates pi_train / pi_rollout at C."""
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
        default=(0.9, 0.999), validator=v.deep_iterable(v.and_(v.ge(0.0), v.lt(1.0))))
    """AdamW betas, each in [0, 1)."""
    warmup_steps: int = attrs.field(default=0, validator=v.ge(0))
    """Steps of linear warmup from 0 to lr."""
    schedule: Literal["constant", "linear"] = attrs.field(
        default="constant", validator=v.in_(("constant", "linear")))
    """After warmup: lr held, or decayed linearly to 0 at the run's last optimizer step (TRL's
    default)."""
    max_grad_norm: float = attrs.field(default=1.0, validator=v.gt(0.0))
    """Gradients are clipped to this global norm; a non-finite norm skips the step."""


@attrs.frozen(kw_only=True)
class LoraConfig:
    """`--train.lora.*`: train low-rank adapters instead of every weight."""

    rank: int = attrs.field(default=0, validator=v.ge(0))
    """Adapter rank r; 0 trains every weight (no LoRA)."""
    alpha: float = attrs.field(default=32.0, validator=v.gt(0))
    """The update to a weight is alpha / rank * B @ A."""
    target_modules: tuple[str, ...] = attrs.field(default=("all-linear",),
                                                  validator=v.min_len(1))
    """Module names that get adapters (q_proj v_proj ...), or all-linear (all but the LM head)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def peft_dict(self) -> dict[str, Any]:
        """The adapter's PEFT config, before it is resolved against a model."""
        targets = "all-linear" if self.target_modules == ("all-linear",) \
            else list(self.target_modules)
        return {"peft_type": "LORA", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": targets, "lora_dropout": 0.0, "bias": "none"}


_converter = cattrs.Converter(forbid_extra_keys=True)


@attrs.frozen(kw_only=True)
class InferenceConfig:
    """Where rollouts are generated: the in-process local engine, or SGLang(-protocol) servers."""

    backend: str = "local"
    """A registered generation pool: local (in-process engine) or sglang (HTTP servers)."""
    dtype: Literal["auto", "float32", "bfloat16"] = attrs.field(
        default="auto", validator=v.in_(("auto", "float32", "bfloat16")))
    """Local engine (and launched servers') weight dtype; auto: whichever decodes faster here (bf16
    on a GPU). In the trainer's dtype it shares the trainer's weights."""
    max_batch_size: int = attrs.field(default=64, validator=v.ge(1))
    """Most sequences the local engine decodes at once."""
    threads: int | None = attrs.field(default=None, validator=v.optional(v.ge(1)))
    """CPU threads of the local engine's own pool; None: the process's (fastest for SmolLM2)."""
    hosted: bool = True
    """The local engine decodes on the trainer's thread while it waits for a batch."""
    decode_while_training: bool = False
    """The local engine decodes during training (off: it slowed training 2-2.4x on 2 cores)."""
    device: str = attrs.field(default="auto")
    """Where the local engine (and launched servers) run: auto (cuda if any), cpu, cuda, cuda:N."""
    deterministic: bool = False
    """Launch SGLang with --enable-deterministic-inference (slower; honours per-request seeds)."""
    addresses: tuple[str, ...] = ()
    """Running servers (host:port) for the sglang backend; none given launches `servers`."""
    addresses_file: str | None = None
    """A file of server addresses, one per line, re-read while training (servers join/leave)."""
    server_gpus: tuple[int, ...] = (0,)
    """GPUs for launched servers (one per tp_size of them), apart from the training ranks' GPUs."""
    tp_size: int = attrs.field(default=1, validator=v.ge(1))
    """Tensor-parallel GPUs per launched SGLang server."""
    server_program: Literal["sglang", "areal-flow"] = attrs.field(
        default="sglang", validator=v.in_(("sglang", "areal-flow")))
    """What launched servers run: sglang (GPUs), or `areal-flow serve` (the local engine)."""
    request_timeout: float = attrs.field(default=3600.0, validator=v.gt(0))
    """sglang: seconds a /generate call may take before its server leaves rotation (retried)."""
    control_timeout: float = attrs.field(default=600.0, validator=v.gt(0))
    """sglang: seconds a weight load or a weight-update group call may take."""
    pause_timeout: float = attrs.field(default=30.0, validator=v.gt(0))
    """sglang: seconds a pause/resume call may take before the server leaves rotation."""
    no_server_timeout: float = attrs.field(default=600.0, validator=v.gt(0))
    """sglang: seconds a request waits for a server in rotation before it fails."""
    startup_timeout: float = attrs.field(default=120.0, validator=v.ge(0))
    """sglang, servers given by address: seconds to wait at start for one to answer /health."""
    health_timeout: float = attrs.field(default=30.0, validator=v.gt(0))
    """sglang: seconds a /health check may take; a frozen server leaves rotation after it."""
    lease_dir: str | None = None
    """sglang: a folder all runs reach, to lease servers in; None: ~/.cache/areal_flow/leases."""

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
        problems = cattrs.transform_error(exc, path=cls.__name__, format_exception=_describe) \
            if isinstance(exc, cattrs.BaseValidationError) else [str(exc)]
        raise ConfigError(f"invalid {cls.__name__}:\n" + "\n".join(f"  - {p}" for p in problems)) \
            from None


def load(cls: type[T], path: str | Path) -> T:
    """Read a YAML or JSON file into `cls` (JSON is YAML, so one parser reads both)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
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
