"""Shared types and protocols: the contracts between generation, rollout and training.

This module must not import torch at run time: reward worker processes import
``areal_flow`` and stay light. Tensor-holding types only name torch in annotations.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import attrs
from attrs import validators as v

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

FinishReason = Literal["stop", "length", "abort"]
"""Why generation ended: a stop token/string, the token budget, or an explicit cancellation."""

NormalizerUnit = Literal["tokens", "sequences", "constant"]
"""How the runtime combines `LossOutput.normalizer` across micro-batches and ranks:
tokens and sequences are summed; a constant is used as it is."""

Role = Literal["actor", "ref", "critic", "teacher"]

BATCH_KEYS = (
    "input_ids",
    "attention_mask",
    "loss_mask",
    "logprobs",
    "versions",
    "rewards",
    "group_ids",
    "temperature",
)
"""Keys every training batch carries (docs/architecture.md, "Batches")."""


def _tuple_of_ints(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in value)


# ---------------------------------------------------------------------------- generation


def derived_seed(*parts: object) -> int:
    """A sampling seed that is a pure function of `parts` (a run's seed, a group's admission
    number, an episode's index, ...): the same request gets the same random stream in any
    process and whatever else runs beside it. A non-negative int64."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


class RunEndingError(RuntimeError):
    """An error after which the run must not go on (a reward failing over its limit): the
    scheduler never retries it as a workflow error; it ends training and evaluation alike."""


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Per-request sampling settings (names follow SGLang's `sampling_params`)."""

    max_new_tokens: int = attrs.field(default=128, validator=v.ge(1))
    """Largest number of tokens to generate."""
    temperature: float = attrs.field(default=1.0, validator=v.ge(0.0))
    """Softmax temperature; 0 means greedy."""
    top_p: float = attrs.field(default=1.0, validator=[v.gt(0.0), v.le(1.0)])
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = attrs.field(default=-1, validator=v.ge(-1))
    """Sample from the k most likely tokens; -1 disables it (0 is not allowed)."""
    min_p: float = attrs.field(default=0.0, validator=[v.ge(0.0), v.le(1.0)])
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_ints)
    """Extra token ids that end generation (the model's EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks and interruption tests)."""
    seed: int | None = attrs.field(default=None,
                                   validator=v.optional([v.ge(0), v.lt(2**64)]))
    """Per-request sampling seed in [0, 2**64), for reproducible sampled generations."""

    def __attrs_post_init__(self) -> None:
        if self.top_k == 0:
            raise ValueError("'top_k' must be -1 (disabled) or >= 1: 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The T in the behavior logprobs ``log_softmax(logits / T)``: greedy requests report T = 1,
        as SGLang does."""
        return self.temperature if self.temperature > 0 else 1.0


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One sequence to continue: prompt token ids in, a `Completion` out."""

    input_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    episode_id: str | None = None
    """Requests of one episode share it, so a multi-server pool routes them to the same server
    (its prefix cache already holds the earlier turns)."""
    rid: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    """Request id, as in SGLang's `rid` (used to abort one request)."""

    def __attrs_post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("'input_ids' must hold at least one token")


@attrs.frozen(kw_only=True)
class Completion:
    """Generated tokens with their behavior logprobs and the weight version that produced each."""

    token_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    logprobs: tuple[float, ...] = attrs.field(converter=lambda xs: tuple(float(x) for x in xs))
    """``log_softmax(logits / T)`` over the full vocabulary at each sampled token, where T is
    `temperature`; taken after temperature and before top-k/top-p truncation."""
    versions: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    """Weight version that produced each token (an interrupted request mixes versions)."""
    finish_reason: FinishReason = attrs.field(validator=v.in_(("stop", "length", "abort")))
    temperature: float = attrs.field(default=1.0, validator=v.gt(0.0))
    """The T of `logprobs` (1.0 for greedy requests); see `SamplingParams.logprob_temperature`."""
    text: str | None = None

    def __attrs_post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"a Completion needs one logprob and one version per token: {n} tokens, "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions"
            )


@attrs.frozen(kw_only=True)
class DistributedWeights:
    """Metadata of tensors the trainer broadcasts over a weight-update process group
    (SGLang's `/update_weights_from_distributed`)."""

    names: tuple[str, ...] = attrs.field(converter=tuple)
    dtypes: tuple[str, ...] = attrs.field(converter=tuple)
    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda xs: tuple(tuple(s) for s in xs))
    group_name: str = "weight_update_group"

    def __attrs_post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("'names', 'dtypes' and 'shapes' must have the same length")


@attrs.frozen(kw_only=True)
class WeightUpdate:
    """New policy weights for a generation pool, in exactly one of three forms."""

    version: int = attrs.field(validator=v.ge(0))
    state_dict: Mapping[str, torch.Tensor] | None = None
    """Full (unsharded) tensors in memory, for an in-process engine."""
    path: str | None = None
    """A `save_pretrained` folder, for `/update_weights_from_disk`."""
    dist_meta: DistributedWeights | None = None
    """Tensors that follow over the weight-update group, for `/update_weights_from_distributed`."""
    live: bool = False
    """`state_dict` holds the trainer's own tensors, which it changes in place: an in-process
    pool may keep them instead of copying (its `update_weights` returns True), and the trainer
    then pauses it before each optimizer step; the next update resumes it (`TrainEngine`)."""
    lora: Mapping[str, Any] | None = None
    """A PEFT LoRA config: the weights are a LoRA adapter over the base model the pool started
    with (`areal_flow/lora.py`), not the model itself: `path` is a PEFT adapter folder (SGLang's
    ``/load_lora_adapter``), `state_dict` holds the adapter tensors (and may hold the base
    model's too, when `live`)."""

    def __attrs_post_init__(self) -> None:
        given = [f for f in ("state_dict", "path", "dist_meta") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                "a WeightUpdate carries exactly one of 'state_dict', 'path', 'dist_meta'; "
                f"got {given or 'none'}"
            )


@runtime_checkable
class GenerationPool(Protocol):
    """Where workflows get tokens: the in-process local engine or a set of SGLang servers.

    `generate` is async and runs on the rollout scheduler's event loop. The control methods are
    blocking and thread-safe, because the trainer thread calls them during weight sync.
    Interruption is invisible: `generate` never returns ``abort`` because of `pause` or
    `update_weights`; it resubmits prompt + tokens so far after `resume`, and each token keeps
    the version that produced it. ``abort`` is returned only for an explicit cancellation.
    """

    in_process: bool
    """True when `update_weights` takes an in-memory ``state_dict`` (the pool lives in the
    trainer's process); False when weights come as a folder or over a weight-update group."""

    @classmethod
    def from_config(cls, config: Any, *, model: str, seed: int = 0,
                    run_dir: Any = None, lora: Any = None) -> GenerationPool:
        """Build the pool a recipe's `areal_flow.config.InferenceConfig` describes; `lora` is
        the trainer's `areal_flow.lora.LoraConfig` when it trains LoRA adapters (passed only
        then), whose adapters the pool will receive as `WeightUpdate.lora`."""
        ...

    @property
    def version(self) -> int:
        """The weight version new tokens are generated with."""
        ...

    async def generate(self, request: GenerationRequest) -> Completion: ...

    def pause(self) -> None:
        """Stop generating; running requests are interrupted and wait for `resume`."""
        ...

    def resume(self) -> None: ...

    def update_weights(self, update: WeightUpdate) -> bool | None:
        """Load new weights and set `version` to ``update.version``. True: the pool kept the
        tensors of a `live` update instead of copying them."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters since the last call (the recipe logs and resets them every step)."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- episodes


@attrs.frozen(kw_only=True)
class Segment:
    """A run of tokens in an episode: model output (trainable) or prompt/environment tokens."""

    token_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    trainable: bool
    logprobs: tuple[float, ...] = attrs.field(converter=lambda xs: tuple(float(x) for x in xs))
    versions: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)

    def __attrs_post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError("a Segment needs one logprob and one version per token")
        if not self.trainable and any(x != -1 for x in self.versions):
            raise ValueError("prompt and environment tokens carry version -1")

    @classmethod
    def environment(cls, token_ids: Sequence[int]) -> Segment:
        """Tokens the model did not produce (prompt, tool output): not trained on."""
        n = len(token_ids)
        return cls(token_ids=token_ids, trainable=False, logprobs=[0.0] * n, versions=[-1] * n)


@attrs.define(kw_only=True)
class Episode:
    """One trajectory: token segments, a scalar reward and free-form `info`.

    Multi-turn discounts are folded into the scalar `reward` by the workflow. All model tokens of
    one episode must share a logprob temperature, which the trainer uses to recompute logprobs.
    """

    segments: list[Segment] = attrs.field(factory=list)
    reward: float | None = None
    info: dict[str, Any] = attrs.field(factory=dict)
    """Free-form facts about the episode (JSON-able), written to samples.jsonl with it."""
    metrics: dict[str, float] = attrs.field(factory=dict)
    """The task's own numbers (e.g. accuracy), averaged over each batch into metrics.jsonl and the
    live panel, and over eval episodes as eval/<name>. A reward's `metrics` function fills it
    through `ctx.reward`; a workflow may set more."""
    rates: set[str] = attrs.field(factory=set, converter=set)
    """The names in `metrics` that are rates (each value 0 or 1): eval gives their mean a 95%
    Wilson interval; any other metric is a value (a count, a length: a mean only). A reward's
    `rates` enter through `ctx.reward`; a workflow adds the rates it sets itself."""
    temperature: float | None = None
    truncated: bool = False
    """The episode did not end, it was cut: its last model turn stopped at its token budget
    (finish reason `length`), or an environment or turn limit stopped it (gymnasium's
    `truncated`). Value-based advantages bootstrap instead of treating it as final."""

    @classmethod
    def start(
        cls,
        prompt_ids: Sequence[int],
        completion: Completion | None = None,
        *,
        reward: float | None = None,
    ) -> Episode:
        ep = cls(segments=[Segment.environment(prompt_ids)], reward=reward)
        if completion is not None:
            ep.add(completion)
        return ep

    def add(self, completion: Completion) -> Episode:
        """Append model tokens: trainable, with their logprobs and versions."""
        if self.temperature is not None and completion.temperature != self.temperature:
            raise ValueError(
                f"an episode mixes logprob temperatures {self.temperature} and "
                f"{completion.temperature}; the trainer recomputes logprobs at one temperature "
                "per episode"
            )
        self.temperature = completion.temperature
        self.truncated = completion.finish_reason == "length"
        self.segments.append(
            Segment(
                token_ids=completion.token_ids,
                trainable=True,
                logprobs=completion.logprobs,
                versions=completion.versions,
            )
        )
        return self

    def add_tokens(self, token_ids: Sequence[int]) -> Episode:
        """Append environment or tool tokens: part of the context, never trained on."""
        self.segments.append(Segment.environment(token_ids))
        return self

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def loss_mask(self) -> list[bool]:
        return [s.trainable for s in self.segments for _ in s.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [x for s in self.segments for x in s.logprobs]

    @property
    def versions(self) -> list[int]:
        return [x for s in self.segments for x in s.versions]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def num_trainable_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.trainable)


# ---------------------------------------------------------------------------- training


@attrs.frozen(kw_only=True)
class ModelOutput:
    """What a forward pass gives an algorithm, aligned with the batch's ``input_ids``
    (position t holds the quantity for token t given tokens < t). Log-probs and entropy are
    computed only where ``loss_mask`` is set and are 0 elsewhere (position 0 always)."""

    logprobs: torch.Tensor
    """[rows, tokens] log-probability of each given token at the episode's temperature."""
    entropy: torch.Tensor | None = None
    """[rows, tokens] entropy of the next-token distribution."""
    values: torch.Tensor | None = None
    """[rows, tokens] critic value estimates (critic role only)."""


@attrs.frozen(kw_only=True)
class LossOutput:
    """A micro-batch's loss as a sum, plus the normalizer the runtime divides the global sum by.

    The runtime sums `loss_sum` and (for tokens/sequences) `normalizer` over every micro-batch
    and data-parallel rank of an optimizer step, so the update does not depend on the split.
    """

    loss_sum: torch.Tensor
    normalizer: float | torch.Tensor
    unit: NormalizerUnit = attrs.field(validator=v.in_(("tokens", "sequences", "constant")))
    stats: dict[str, float | torch.Tensor] = attrs.field(factory=dict)


@runtime_checkable
class Algorithm(Protocol):
    """Loss steps on tensors; never touches processes, devices or sharding.

    ``roles`` names the models whose forward pass over the batch, before the update, it needs:
    ``actor`` → ``prox_logprobs`` (the policy before this update), ``ref`` → ``ref_logprobs``,
    ``critic`` → ``values``, ``teacher`` → ``teacher_logprobs`` (a frozen teacher model of the
    same tokenizer, e.g. for distillation). An algorithm with the ``critic`` role also defines
    ``critic_loss(out: ModelOutput, mb: TensorDict) -> LossOutput``.

    Batch keys besides the collated ones (`areal_flow.data.collate`): ``policy_version`` per row
    (the version being trained, set by the scheduler) and ``minibatch_progress`` per row (the
    fraction of this batch's optimizer steps already taken, set by the runtime).

    What else an algorithm may declare, each with its default, is `AlgorithmCapabilities`.
    """

    roles: tuple[Role, ...]

    def advantages(self, batch: TensorDict) -> TensorDict:
        """Once per batch, without gradients, after the role forwards have filled
        ``ref_logprobs``/``values``/``prox_logprobs``/``teacher_logprobs``."""
        ...

    def loss(self, out: ModelOutput, mb: TensorDict) -> LossOutput:
        """Once per micro-batch."""
        ...


@attrs.frozen(kw_only=True)
class AlgorithmCapabilities:
    """What an `Algorithm` may declare besides `roles`, as attributes of the same names; one it
    does not declare has the default here. The runtime and the recipes read them through `of`."""

    needs_entropy_grad: bool = False
    """The loss differentiates `ModelOutput.entropy` (otherwise entropy comes without gradient,
    for stats)."""
    skips_zero_advantage_rows: bool = False
    """A row whose ``advantages`` are all 0 contributes nothing to the gradient, so the runtime
    skips its forward and backward, still counting it in the normalizer."""
    min_group_size: int = 1
    """An algorithm that scores a row against the rest of its group refuses a smaller
    `--rollout.group-size` at start."""

    @classmethod
    def of(cls, algorithm: Any) -> AlgorithmCapabilities:
        return cls(**{field.name: getattr(algorithm, field.name)
                      for field in attrs.fields(cls) if hasattr(algorithm, field.name)})


# ---------------------------------------------------------------------------- registered things


@runtime_checkable
class DatasetSource(Protocol):
    """Rows a named source makes: ``--dataset '<name>:<spec>'`` reads them from the source
    registered as ``<name>`` (`registry.dataset_sources`, entry-point group
    ``areal_flow.dataset_sources``; reasoning-gym's ``reasoning_gym:<task>?...`` is one)."""

    reward: str
    """The reward the `rlvr` workflow scores these rows with when no --workflow-config says."""
    prompt_template: str
    """`rlvr`'s prompt for these rows when no --workflow-config says (``{question}`` is the
    row's question)."""

    def train_eval_rows(self, dataset: str, eval_size: int
                        ) -> tuple[list[dict], list[dict], str]:
        """The train rows, `eval_size` held-out rows and a line saying what they are."""
        ...

    def task(self, dataset: str) -> str:
        """The task's name, for the run folder's (``chain_sum`` of ``reasoning_gym:chain_sum?...``)."""
        ...



def _positive_timeout(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"'{attribute.name}' must be > 0 seconds: {value!r}")


@attrs.frozen(kw_only=True)
class RewardSpec:
    """A registered reward: ``fn(completion, **kwargs) -> float`` (sync or async)."""

    name: str
    fn: Callable[..., Any]
    timeout: float = attrs.field(default=10.0, validator=_positive_timeout)
    """Wall-clock seconds before a call is killed and scored `default`."""
    default: float = 0.0
    """Score given when the reward raises, crashes or times out."""
    range: tuple[float, float] = attrs.field(default=(0.0, 1.0), converter=tuple)
    """Inclusive (low, high) bounds every score must lie in."""
    metrics: Callable[..., dict[str, float]] | None = None
    """``metrics(completion, **kwargs) -> {name: number}``, called like the reward after it scored
    (in the rollout process: cheap checks only); the numbers go to the episode's `metrics`."""
    rates: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """The `metrics` names that are rates (each value 0 or 1, e.g. accuracy): eval gives their
    mean a 95% Wilson interval. The others are values (counts, lengths, scores): a mean only."""

    def __attrs_post_init__(self) -> None:
        if self.rates and self.metrics is None:
            raise ValueError(f"'rates' {list(self.rates)} name metrics, but reward "
                             f"{self.name!r} declares no 'metrics' function")
        lo, hi = self.range
        if not lo <= hi:
            raise ValueError(f"'range' must be (low, high) with low <= high: {self.range}")
        if not lo <= self.default <= hi:
            raise ValueError(f"'default' must lie within range {self.range}: {self.default}")

    @property
    def target(self) -> Callable[..., Any]:
        return self.fn


@attrs.frozen(kw_only=True)
class WorkflowSpec:
    """A registered workflow: ``async fn(ctx, sample) -> Episode | None``."""

    name: str
    fn: Callable[..., Any]
    config: type | None = None
    """attrs class of the workflow's options (given with ``--workflow-config``)."""

    @property
    def target(self) -> Callable[..., Any]:
        return self.fn


@attrs.frozen(kw_only=True)
class AlgorithmSpec:
    """A registered algorithm class, constructed with an instance of its `config` class."""

    name: str
    cls: type
    config: type | None = None

    @property
    def target(self) -> type:
        return self.cls
