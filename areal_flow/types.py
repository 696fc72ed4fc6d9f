"""Shared types and protocols; no run-time torch import (reward workers import it, stay light)."""

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
"""Over micro-batches and ranks, token/sequence `LossOutput.normalizer`s sum; a constant stays."""

Role = Literal["actor", "ref", "critic", "teacher"]

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards",
              "group_ids", "temperature")
"""Keys every training batch carries (docs/architecture.md, "Batches")."""


def _tuple_of_ints(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in value)


def _one_per_token(instance: Any, attribute: attrs.Attribute, versions: tuple[int, ...]) -> None:
    n, logprobs = len(instance.token_ids), instance.logprobs
    if len(logprobs) != n or len(versions) != n:
        raise ValueError(f"a {type(instance).__name__} needs one logprob and one version per "
                         f"token: {n} tokens, {len(logprobs)} logprobs, {len(versions)} versions")


# ---------------------------------------------------------------------------- generation


def derived_seed(*parts: object) -> int:
    """A non-negative int64 seed, a pure function of `parts` (reproducible in any process)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


class RunEndingError(RuntimeError):
    """Ends training or evaluation (e.g. a reward failing over its limit); never retried."""


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
        """The T in the behavior logprobs ``log_softmax(logits / T)``; 1 if greedy (as SGLang)."""
        return self.temperature if self.temperature > 0 else 1.0


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One sequence to continue: prompt token ids in, a `Completion` out."""

    input_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    episode_id: str | None = None
    """Shared by an episode's requests: a server pool sends them to one server (prefix cache)."""
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
    """``log_softmax(logits / T)``, T = `temperature`, over the full vocab, before top-k/p."""
    versions: tuple[int, ...] = attrs.field(converter=_tuple_of_ints, validator=_one_per_token)
    """Weight version that produced each token (an interrupted request mixes versions)."""
    finish_reason: FinishReason = attrs.field(validator=v.in_(("stop", "length", "abort")))
    temperature: float = attrs.field(default=1.0, validator=v.gt(0.0))
    """The T of `logprobs` (1.0 for greedy requests)."""
    text: str | None = None


@attrs.frozen(kw_only=True)
class DistributedWeights:
    """Metadata of tensors sent over a weight-update group (`/update_weights_from_distributed`)."""

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
    """`state_dict` is the trainer's own tensors, changed in place: a pool may keep them (returning
    True); the trainer then pauses it per optimizer step, and the next update resumes it."""
    lora: Mapping[str, Any] | None = None
    """A PEFT LoRA config: the weights are an adapter over the pool's base model (`lora.py`):
    `path` is a PEFT adapter folder, `state_dict` the adapter tensors (+ base ones if `live`)."""

    def __attrs_post_init__(self) -> None:
        given = [f for f in ("state_dict", "path", "dist_meta") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("a WeightUpdate carries exactly one of 'state_dict', 'path', "
                             f"'dist_meta'; got {given or 'none'}")


@runtime_checkable
class GenerationPool(Protocol):
    """Where workflows get tokens (local engine or SGLang servers). `generate` is async, on the
    rollout loop; control methods block and are thread-safe (the trainer calls them). `generate`
    returns ``abort`` only on cancel: after `pause` it resubmits at `resume`, keeping versions."""

    in_process: bool
    """True: `update_weights` takes an in-memory ``state_dict``; False: folder or weight group."""

    @classmethod
    def from_config(cls, config: Any, *, model: str, seed: int = 0,
                    run_dir: Any = None, lora: Any = None) -> GenerationPool:
        """The pool an `InferenceConfig` describes; `lora`: the trainer's `LoraConfig`, if any."""

    @property
    def version(self) -> int:
        """The weight version new tokens are generated with."""

    async def generate(self, request: GenerationRequest) -> Completion: ...

    def pause(self) -> None:
        """Stop generating; running requests are interrupted and wait for `resume`."""

    def resume(self) -> None: ...

    def update_weights(self, update: WeightUpdate) -> bool | None:
        """Load weights, set `version`; True if it kept a `live` update's tensors (no copy)."""

    def stats(self) -> dict[str, float]:
        """Counters since the last call (the recipe logs and resets them every step)."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- episodes


@attrs.frozen(kw_only=True)
class Segment:
    """A run of tokens in an episode: model output (trainable) or prompt/environment tokens."""

    token_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    trainable: bool
    logprobs: tuple[float, ...] = attrs.field(converter=lambda xs: tuple(float(x) for x in xs))
    versions: tuple[int, ...] = attrs.field(converter=_tuple_of_ints, validator=_one_per_token)

    def __attrs_post_init__(self) -> None:
        if not self.trainable and any(x != -1 for x in self.versions):
            raise ValueError("prompt and environment tokens carry version -1")

    @classmethod
    def environment(cls, token_ids: Sequence[int]) -> Segment:
        """Tokens the model did not produce (prompt, tool output): not trained on."""
        n = len(token_ids)
        return cls(token_ids=token_ids, trainable=False, logprobs=[0.0] * n, versions=[-1] * n)


@attrs.define(kw_only=True)
class Episode:
    """One trajectory: token segments, a scalar reward (multi-turn discounts folded in) and `info`.
    All its model tokens share one logprob temperature (the trainer recomputes logprobs at it)."""

    segments: list[Segment] = attrs.field(factory=list)
    reward: float | None = None
    info: dict[str, Any] = attrs.field(factory=dict)
    """Free-form facts about the episode (JSON-able), written to samples.jsonl with it."""
    metrics: dict[str, float] = attrs.field(factory=dict)
    """The task's own numbers (e.g. accuracy), averaged per batch and over eval as eval/<name>."""
    rates: set[str] = attrs.field(factory=set, converter=set)
    """Names in `metrics` that are 0/1 rates (eval: a 95% Wilson interval; others: a mean)."""
    temperature: float | None = None
    truncated: bool = False
    """Cut, not ended (token budget, env or turn limit): value-based advantages bootstrap."""

    @classmethod
    def start(cls, prompt_ids: Sequence[int], completion: Completion | None = None, *,
              reward: float | None = None) -> Episode:
        ep = cls(segments=[Segment.environment(prompt_ids)], reward=reward)
        if completion is not None:
            ep.add(completion)
        return ep

    def add(self, completion: Completion) -> Episode:
        """Append model tokens: trainable, with their logprobs and versions."""
        if self.temperature is not None and completion.temperature != self.temperature:
            raise ValueError(f"an episode mixes logprob temperatures {self.temperature} and "
                             f"{completion.temperature}; the trainer recomputes logprobs at one "
                             "temperature per episode")
        self.temperature = completion.temperature
        self.truncated = completion.finish_reason == "length"
        self.segments.append(Segment(token_ids=completion.token_ids, trainable=True,
                                     logprobs=completion.logprobs, versions=completion.versions))
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
    """A forward pass aligned with ``input_ids`` (position t: token t given tokens < t); logprobs
    and entropy are 0 where ``loss_mask`` is unset (position 0 always)."""

    logprobs: torch.Tensor
    """[rows, tokens] log-probability of each given token at the episode's temperature."""
    entropy: torch.Tensor | None = None
    """[rows, tokens] entropy of the next-token distribution."""
    values: torch.Tensor | None = None
    """[rows, tokens] critic value estimates (critic role only)."""


@attrs.frozen(kw_only=True)
class LossOutput:
    """A micro-batch's summed loss: the runtime sums `loss_sum` and (tokens/sequences) `normalizer`
    over a step's micro-batches and DP ranks, then divides, so the split does not matter."""

    loss_sum: torch.Tensor
    normalizer: float | torch.Tensor
    unit: NormalizerUnit = attrs.field(validator=v.in_(("tokens", "sequences", "constant")))
    stats: dict[str, float | torch.Tensor] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class MicroBatch:
    """What a loss reads: rows of one optimizer step, on the trainer's device; [rows, tokens]
    tensors aligned with ``input_ids`` unless marked [rows]. The runtime sets every field up to
    ``minibatch_progress`` (``policy_version``: RL batches, from the scheduler); each role, the
    field it names; an algorithm's `advantages`, ``advantages`` (and ``returns``)."""

    loss_mask: torch.Tensor
    """Tokens the loss trains on (the model's own tokens)."""
    logprobs: torch.Tensor | None = None
    """log π_behav: the rollout engine's log-probability of each token, 0 off `loss_mask`."""
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    """The policy version that sampled each token (-1 off `loss_mask`)."""
    rewards: torch.Tensor | None = None
    """[rows] the episode's reward."""
    group_ids: torch.Tensor | None = None
    """[rows] rows of one group share an id (`collate_groups`)."""
    truncated: torch.Tensor | None = None
    """[rows] the last model turn hit its token budget."""
    temperature: torch.Tensor | None = None
    """[rows] the sampling temperature `ModelOutput.logprobs` are taken at."""
    minibatch_progress: torch.Tensor | None = None
    """[rows] the fraction of this batch's optimizer steps already taken (0 on the first)."""
    policy_version: torch.Tensor | None = None
    """[rows] the trainer's version when the batch was made (RL batches)."""
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    prox_logprobs: torch.Tensor | None = None
    """log π_prox, the ``actor`` role's forward at the weights before this batch's first step."""
    ref_logprobs: torch.Tensor | None = None
    """The ``ref`` role's forward (the frozen reference model)."""
    values: torch.Tensor | None = None
    """The ``critic`` role's values before the update."""
    teacher_logprobs: torch.Tensor | None = None
    """The ``teacher`` role's forward."""
    columns: TensorDict | None = None
    """The batch's other columns: an algorithm's own (DPO's ``chosen``), a workflow's."""

    @classmethod
    def of(cls, batch: TensorDict) -> MicroBatch:
        """The micro-batch of a TensorDict's rows: its keys named as fields go to the fields."""
        named = set(attrs.fields_dict(cls)) - {"columns"}
        return cls(**{key: batch[key] for key in named & set(batch.keys())},
                   columns=batch.exclude(*named))


@attrs.frozen
class RoleForward:
    """What a role's model computes before the update, and where the loss reads it."""

    fills: str = attrs.field(validator=attrs.validators.in_(
        sorted(set(attrs.fields_dict(MicroBatch)) - {"columns"})))
    """The `MicroBatch` field (and batch key) it fills."""
    output: Literal["logprobs", "values"]
    """The output of its `TrainEngine.forward` it takes: a policy's log-probs, a critic's values."""


ROLES: dict[Role, RoleForward] = {
    "actor": RoleForward("prox_logprobs", "logprobs"),  # the policy before this batch's update
    "ref": RoleForward("ref_logprobs", "logprobs"),
    "critic": RoleForward("values", "values"),
    "teacher": RoleForward("teacher_logprobs", "logprobs"),
}
"""Each `Role`'s forward (`TrainEngine.role_forwards`)."""


@runtime_checkable
class Algorithm(Protocol):
    """Loss steps on tensors; never touches processes, devices or sharding.

    ``roles``: models whose pre-update forward it needs, each filling a `MicroBatch` field (and
    the batch key of that name; `ROLES`): ``actor`` → ``prox_logprobs``, ``ref`` →
    ``ref_logprobs``, ``critic`` → ``values`` (then also define ``critic_loss(out, mb) -> LossOutput``),
    ``teacher`` → ``teacher_logprobs`` (frozen, same tokenizer). Optional attributes:
    `AlgorithmCapabilities`. State kept between steps (GRPO's adaptive entropy coefficient)
    goes into checkpoints through optional ``state_dict() -> dict`` and ``load_state_dict``."""

    roles: tuple[Role, ...]

    def advantages(self, batch: TensorDict) -> TensorDict:
        """Once per batch, without gradients, after the role forwards filled their keys."""

    def loss(self, out: ModelOutput, mb: MicroBatch) -> LossOutput:
        """Once per micro-batch."""


@attrs.frozen(kw_only=True)
class AlgorithmCapabilities:
    """Optional `Algorithm` attributes with their defaults; the runtime reads them through `of`."""

    needs_entropy_grad: bool = False
    """The loss differentiates `ModelOutput.entropy` (else entropy has no gradient, for stats)."""
    skips_zero_advantage_rows: bool = False
    """Rows with all-zero ``advantages`` skip forward/backward (still counted in normalizer)."""
    min_group_size: int = 1
    """Smallest `--rollout.group-size` allowed (for algorithms scoring a row against its group)."""

    @classmethod
    def of(cls, algorithm: Any) -> AlgorithmCapabilities:
        return cls(**{field.name: getattr(algorithm, field.name)
                      for field in attrs.fields(cls) if hasattr(algorithm, field.name)})


# ---------------------------------------------------------------------------- registered things


@runtime_checkable
class DatasetSource(Protocol):
    """Rows for ``--dataset '<name>:<spec>'``, from the source registered as ``<name>``
    (`registry.dataset_sources`, entry-point group ``areal_flow.dataset_sources``)."""

    reward: str
    """The reward the `rlvr` workflow scores these rows with when no --workflow-config says."""
    prompt_template: str
    """`rlvr`'s default prompt for these rows (``{question}`` is the row's question)."""

    def train_eval_rows(self, dataset: str, eval_size: int
                        ) -> tuple[list[dict], list[dict], str]:
        """The train rows, `eval_size` held-out rows and a line saying what they are."""

    def task(self, dataset: str) -> str:
        """The task's name for the run folder (``chain_sum`` of ``reasoning_gym:chain_sum?``)."""


@attrs.frozen(kw_only=True)
class RewardSpec:
    """A registered reward: ``fn(completion, **kwargs) -> float`` (sync or async)."""

    name: str
    fn: Callable[..., Any]
    timeout: float = attrs.field(default=10.0, validator=v.gt(0))
    """Wall-clock seconds before a call is killed and scored `default`."""
    default: float = 0.0
    """Score given when the reward raises, crashes or times out."""
    range: tuple[float, float] = attrs.field(default=(0.0, 1.0), converter=tuple)
    """Inclusive (low, high) bounds every score must lie in."""
    metrics: Callable[..., dict[str, float]] | None = None
    """``metrics(completion, **kwargs) -> {name: number}`` into `Episode.metrics` (keep cheap)."""
    rates: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """The `metrics` names that are 0/1 rates (e.g. accuracy); see `Episode.rates`."""

    def __attrs_post_init__(self) -> None:
        if self.rates and self.metrics is None:
            raise ValueError(f"'rates' {list(self.rates)} name metrics, but reward "
                             f"{self.name!r} declares no 'metrics' function")
        lo, hi = self.range
        if not lo <= hi:
            raise ValueError(f"'range' must be (low, high) with low <= high: {self.range}")
        if not lo <= self.default <= hi:
            raise ValueError(f"'default' must lie within range {self.range}: {self.default}")

    target = property(lambda self: self.fn)


@attrs.frozen(kw_only=True)
class WorkflowSpec:
    """A registered workflow: ``async fn(ctx, sample) -> Episode | None``."""

    name: str
    fn: Callable[..., Any]
    config: type | None = None
    """attrs class of the workflow's options (given with ``--workflow-config``)."""

    target = property(lambda self: self.fn)


@attrs.frozen(kw_only=True)
class AlgorithmSpec:
    """A registered algorithm class, constructed with an instance of its `config` class."""

    name: str
    cls: type
    config: type | None = None

    target = property(lambda self: self.cls)
