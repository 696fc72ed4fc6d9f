"""The SPMD training engine: a Hugging Face causal LM (or a value model) sharded with FSDP2.

Every rank runs the same code (`torchrun`; one process is a valid world); rank 0 holds the full
batch. Each micro-batch's `loss_sum` is back-propagated unscaled, then the gradients are scaled
by world / (normalizers summed over micro-batches and ranks, or the constant), so the update
does not depend on how the batch was split."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist
from attrs import validators as v
from tensordict import TensorDict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, get_scheduler

from areal_flow.config import LoraConfig, OptimizerConfig
from areal_flow.runtime.distributed import (init_distributed, on_rank0, same_on_all_ranks,
                                            scatter_groups)
from areal_flow.runtime import compiled_layers, packed_attention
from areal_flow.runtime.layout import PackedRows
from areal_flow.runtime.logprobs import EntropyMode, LossPositions, loss_position_head
from areal_flow.runtime.microbatch import micro_batches, minibatch_of_rows, split_to_count
from areal_flow.runtime.precision import choose, gemm_rate
from areal_flow.runtime.roles import BaseModelRole, ValueModel
from areal_flow.types import (ROLES, Algorithm, AlgorithmCapabilities, MicroBatch,
                              ModelOutput, WeightUpdate)


@attrs.frozen(kw_only=True)
class TrainConfig:
    """How the policy (and critic) are trained."""

    optim: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    max_tokens_per_mb: int = attrs.field(default=8192, validator=v.ge(1))
    """Tokens per micro-batch (rows packed, no padding). Keep it small on a CPU unless
    `packed_attention` is on: sdpa's block-diagonal mask is quadratic in a pack's tokens."""
    ppo_minibatches: int = attrs.field(default=1, validator=v.ge(1))
    """Optimizer steps per batch; the batch's groups are split evenly between them."""
    dtype: Literal["auto", "float32", "bfloat16"] = attrs.field(
        default="float32", validator=v.in_(("auto", "float32", "bfloat16")))
    """bfloat16: bf16 compute, fp32 master weights and gradient reduction; auto: bf16 where
    measured faster for this model (always on a GPU; `runtime/precision.py`)."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in backward to save memory."""
    keep_unsharded: bool = True
    """One bf16 process: keep FSDP2's gathered bf16 weights through a step's micro-batches and
    reduce gradients once (recasting them per micro-batch was 30 % of a SmolLM2 step)."""
    packed_attention: bool = False
    """Each row of a packed micro-batch attends on its own (`packed_attention.py`): 1.62x for an
    8,192-token pack on a CPU. Off by default: its gradients are close to the mask's, not equal."""
    compile: Literal["auto", "on", "off"] = attrs.field(
        default="off", validator=v.in_(compiled_layers.SETTINGS))
    """torch.compile the decoder layers' MLP and norms (`compiled_layers.py`): 1.36x a SmolLM2
    step. auto: on a CPU with a C++ compiler; not on a GPU (not measured)."""
    skip_nonfinite: bool = False
    """Skip (with a warning) an optimizer step with a NaN/inf loss or gradient norm, not stop."""
    lora: LoraConfig = attrs.field(factory=LoraConfig)
    """Train LoRA adapters of the policy instead of every weight (`--train.lora.rank 16`)."""


@attrs.define
class Shard:
    """A batch between training stations: this rank's rows and the row indices each rank owns;
    before a role-less algorithm's `advantages`, rank 0's whole batch (else None), `owned` None."""

    rows: Any
    owned: list[list[int]] | None = None


@attrs.frozen(kw_only=True)
class StepTotals:
    """What an optimizer step adds up over its micro-batches (and then over ranks)."""

    loss_sum: float
    normalizer: float
    micro_batches: int
    skipped_rows: int
    """Rows whose advantages are all 0, given no forward or backward."""
    tokens: int

    def summed_over_ranks(self) -> StepTotals:
        values = torch.tensor(attrs.astuple(self), dtype=torch.float64)
        dist.all_reduce(values)
        return StepTotals(**{name: type(getattr(self, name))(total) for name, total
                             in zip(attrs.fields_dict(StepTotals), values.tolist())})


class TrainEngine:
    """One model (a `save_pretrained` folder; `value`: a critic) under FSDP2 with its optimizer
    (none when `trainable` is False: a frozen reference)."""

    def __init__(self, model: str | Path, config: TrainConfig, *, value: bool = False,
                 trainable: bool = True, total_steps: int | None = None):
        """`total_steps`: the run's optimizer steps, where a decaying `optim.schedule` ends."""
        self.rank, self.world_size, self.device = init_distributed()
        _return_freed_memory()
        self.config = config
        self.value = value
        self.path = path = str(model)
        module = ValueModel(path) if value else AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa")
        self.adapter: dict | None = None
        """The PEFT config of the policy's LoRA adapters (`TrainConfig.lora`), else None."""
        if config.lora.enabled and trainable and not value:
            from areal_flow.lora import add_adapters  # peft: the lora extra

            self.adapter = add_adapters(module, config.lora.peft_dict())
        body = module.backbone if value else module
        packed_attention.use(body, rows_alone=config.packed_attention)
        if config.activation_checkpointing:
            body.activation_checkpointing_enable()
        # training mode: transformers recomputes checkpointed layers only when `module.training`
        # (from_pretrained returns eval mode, where activation checkpointing silently does nothing)
        module.train(trainable)
        module.to(self.device)
        self.compiled = compiled_layers.wanted(config.compile, self.device)
        if self.compiled:
            compiled_layers.compile_pointwise_parts(body)
        # every rank computes in the dtype rank 0 measured (FSDP2 needs one policy)
        self.precision = same_on_all_ranks(choose(config.dtype, path, purpose="train",
                                                  device=self.device) if self.rank == 0 else None)
        bf16 = self.precision.torch_dtype is torch.bfloat16
        self.n_params = sum(p.numel() for p in module.parameters())
        self._gemm_rate: float | None = None
        # In a one-process fp32 world FSDP2 has nothing to shard and only copies every parameter
        # and gradient through its collective buffers (0.6x the speed of the bare model,
        # benchmarks/README.md); in bf16 its mixed-precision policy does the casting, so it stays.
        self.sharded = self.world_size > 1 or bf16
        if self.sharded:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if bf16 else MixedPrecisionPolicy()
            layer_types = set(module._no_split_modules or ())
            for layer in [m for m in module.modules() if type(m).__name__ in layer_types]:
                fully_shard(layer, mp_policy=policy)
            fully_shard(module, mp_policy=policy)
        self.model = module
        # `_unsharded_state` is then the parameters themselves, not gathered or moved copies
        self.shares_live_tensors = not self.sharded and self.device == torch.device("cpu")
        self.optimizer = self.scheduler = None
        if trainable:
            o = config.optim
            # fused: one kernel per parameter, no foreach temporaries the size of the model
            trained = [p for p in module.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(trained, lr=o.lr, betas=o.betas,
                                               weight_decay=o.weight_decay, fused=True)
            if o.schedule != "constant" and not total_steps:
                raise ValueError(f"optim.schedule={o.schedule!r} decays lr to 0 at the run's "
                                 f"last optimizer step: TrainEngine needs total_steps (got "
                                 f"{total_steps!r}); or use schedule='constant'")
            self.scheduler = get_scheduler(
                "constant_with_warmup" if o.schedule == "constant" else o.schedule,
                self.optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=total_steps)
        else:
            module.requires_grad_(False)
        self.steps = 0
        self._readers: Any = None
        """An in-process pool that generates from this model's own tensors (`sync_weights`)."""

    def reference(self, model: str | Path) -> TrainEngine | BaseModelRole:
        """The frozen reference: with LoRA this policy's own base (adapters off), else `model`."""
        if self.adapter is not None:
            return BaseModelRole(self)
        return TrainEngine(model, self.config, trainable=False)

    # -- forward passes -----------------------------------------------------------------

    def outputs(self, mb: TensorDict, entropy: EntropyMode = "metric") -> ModelOutput:
        """Per-token logprobs (and entropy) at each row's temperature where `loss_mask` is set
        (else 0), or a critic's values, aligned with `input_ids`: t is token t given tokens < t."""
        ids = mb["input_ids"].to(self.device)
        layout = PackedRows.of(ids, mb["attention_mask"].to(self.device))
        if self.value:
            values = layout.unpack(self.model(**layout.model_inputs()).float())
            return ModelOutput(logprobs=torch.zeros_like(values),
                               values=torch.nn.functional.pad(values[:, :-1], (1, 0)))
        where = LossPositions.of(layout, mb["loss_mask"].to(self.device),
                                 mb["temperature"].to(self.device))
        with loss_position_head(self.model, where, entropy) as extra:
            out = self.model(**layout.model_inputs()).logits
        token, ent = (out[:, 0], out[:, 1]) if entropy == "grad" else (out, extra["entropy"])
        return ModelOutput(logprobs=where.scatter(token, ids.shape),
                           entropy=None if ent is None else where.scatter(ent, ids.shape))

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        """`outputs` for this rank's rows, micro-batched; every rank must call it."""
        logprobs, values = (torch.zeros(batch["input_ids"].shape) for _ in range(2))
        for mb_rows in self._plan(batch):
            if not mb_rows:
                self._dummy_pass(backward=False)
                continue
            index = torch.tensor(mb_rows)
            mb = _trim(batch[index])
            out = self.outputs(mb, entropy="none")
            width = mb["input_ids"].shape[1]
            logprobs[index, :width] = out.logprobs.float().cpu()
            if out.values is not None:
                values[index, :width] = out.values.float().cpu()
        if self.sharded:
            # FSDP2 keeps the root module's parameters gathered after its forward, for the
            # backward it expects; none follows this one. Left so, `parameters()` would yield
            # those plain tensors instead of the sharded ones the optimizer holds: a step with
            # no backward (every row skipped) gave them plain gradients, which clip_grad_norm_
            # refused to mix with the layers' DTensors, and the optimizer never saw them.
            self.model.reshard()
        return TensorDict({"logprobs": logprobs, "values": values}, batch_size=batch.batch_size)

    def memory_gb(self) -> dict[str, float]:
        """This rank's training state in GB: weights, gradients of trained ones, optimizer."""
        def local(t: torch.Tensor) -> int:  # a DTensor's own shard
            t = getattr(t, "_local_tensor", t)
            return t.numel() * t.element_size()

        params = list(self.model.parameters())
        state = [] if self.optimizer is None else [
            t for s in self.optimizer.state.values() for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]  # not the step counters
        return {"weights": sum(map(local, params)) / 2**30,
                "gradients": sum(local(q) for q in params if q.requires_grad) / 2**30,
                "optimizer": sum(map(local, state)) / 2**30}

    def mfu(self, tokens: int, seconds: float) -> float:
        """Model FLOPs utilisation: 6 FLOPs per parameter and token over `precision.gemm_rate`."""
        if self._gemm_rate is None:
            self._gemm_rate = gemm_rate(self.path, self.precision.dtype, self.device)
        return 6 * self.n_params * tokens / (seconds * self._gemm_rate)

    # -- training -----------------------------------------------------------------------

    def train(self, batch: TensorDict | None, algorithm: Algorithm, *,
              critic: TrainEngine | None = None, ref: TrainEngine | None = None,
              teacher: TrainEngine | None = None) -> dict:
        """Stations 1-3 in a row; rank 0 passes the batch, others None (exception: all raise)."""
        shard = self.role_forwards(batch, algorithm, critic=critic, ref=ref, teacher=teacher)
        return self.update(self.advantages(shard, algorithm), algorithm, critic=critic)

    def role_forwards(self, batch: TensorDict | None, algorithm: Algorithm, *,
                      critic: TrainEngine | None = None, ref: TrainEngine | None = None,
                      teacher: TrainEngine | None = None) -> Shard:
        """Station 1: scatter rank 0's batch in whole groups; each of `Algorithm.roles` fills its
        output for this rank's rows. Without roles rank 0 keeps the batch whole."""
        engines = {"actor": self, "ref": ref, "critic": critic, "teacher": teacher}
        missing = [role for role in algorithm.roles if engines[role] is None]
        if missing:
            raise ValueError(f"{type(algorithm).__name__} needs a model for the role(s) "
                             f"{missing}: pass train(..., ref=TrainEngine(path, config, "
                             "trainable=False)) / critic=TrainEngine(path, config, value=True) / "
                             "teacher=TrainEngine(teacher_path, config, trainable=False)")
        if isinstance(batch, TensorDict):
            # a shallow copy (the caller's batch keeps its keys) without the episodes' info and
            # task metrics: they are for metrics.jsonl and samples.jsonl and never leave rank 0
            batch = batch.exclude("info", "metrics")
            batch["minibatch"] = minibatch_of_rows(batch["group_ids"], self.config.ppo_minibatches)
        if not algorithm.roles:
            return Shard(batch)
        rows, owned = scatter_groups(batch, self.rank, self.world_size)
        for role in algorithm.roles:
            forward = ROLES[role]
            rows[forward.fills] = engines[role].forward(rows)[forward.output]
        return Shard(rows, owned)

    def advantages(self, shard: Shard, algorithm: Algorithm) -> Shard:
        """Station 2: advantages over the whole batch on rank 0; each rank keeps its rows."""
        if shard.owned is None:  # rank 0's whole batch, not scattered yet
            full = shard.rows
            if self.rank == 0 and isinstance(full, TensorDict):
                full = algorithm.advantages(full)
            return Shard(*scatter_groups(full, self.rank, self.world_size))
        return Shard(on_rank0(algorithm.advantages, shard.rows, shard.owned, self.rank,
                              self.world_size), shard.owned)

    def update(self, shard: Shard, algorithm: Algorithm, *,
               critic: TrainEngine | None = None) -> dict:
        """Station 3: `ppo_minibatches` optimizer steps (and the critic's); returns mean stats."""
        if shard.owned is None:
            raise ValueError("update() takes what advantages() returns")
        can = AlgorithmCapabilities.of(algorithm)
        stats: dict[str, list[float]] = defaultdict(list)
        rows = shard.rows
        minis = [rows[rows["minibatch"] == k] for k in range(self.config.ppo_minibatches)]
        for k, mini in enumerate(minis):
            # how far the weights have moved from pi_prox, for version-based approximations
            mini["minibatch_progress"] = torch.full((mini.batch_size[0],), k / len(minis))
            step = self._step(mini, algorithm.loss,
                              entropy="grad" if can.needs_entropy_grad else "metric",
                              skip_zero_advantage=can.skips_zero_advantage_rows)
            if critic is not None and hasattr(algorithm, "critic_loss"):
                step |= {f"critic/{key}": value
                         for key, value in critic._step(mini, algorithm.critic_loss).items()}
            for key, value in step.items():
                stats[key].append(value)
        # free heap pages back to the OS: without it the GSM8K run's resident memory grew
        # 3.2 -> 4.4 GB over 24 steps (3.7 GB with it)
        _glibc("malloc_trim", 0)
        return {k: sum(vs) / len(vs) for k, vs in stats.items()}

    def _step(self, mini: TensorDict, loss_fn, *, entropy: EntropyMode = "metric",
              skip_zero_advantage: bool = False) -> dict[str, float]:
        """One optimizer step over `mini`. `skip_zero_advantage`: rows of all-zero advantages get
        no forward/backward; their normalizer still counts, so the step is the same."""
        self.optimizer.zero_grad(set_to_none=True)
        moves = mini["advantages"].ne(0).any(-1) if skip_zero_advantage and \
            mini.batch_size[0] else torch.ones(mini.batch_size[0], dtype=torch.bool)
        idle, mini = mini[~moves], mini[moves]
        with self._gathered_through_step() as hold:
            return self._accumulate(mini, idle, loss_fn, entropy, hold)

    @contextlib.contextmanager
    def _gathered_through_step(self):
        """Yields whether FSDP2 keeps gathered weights until the step's last backward."""
        hold = self.config.keep_unsharded and self.sharded and self.world_size == 1
        switches = [self.model.set_reshard_after_forward, self.model.set_reshard_after_backward,
                    self.model.set_requires_gradient_sync] if hold else []
        for switch in switches:
            switch(False)
        try:
            yield hold
        finally:
            for switch in switches:
                switch(True)
            if hold:
                self.model.reshard()

    def _accumulate(self, mini: TensorDict, idle: TensorDict, loss_fn, entropy: EntropyMode,
                    hold: bool) -> dict[str, float]:
        """`_step`'s micro-batches, gradient clipping and optimizer step."""
        loss_sum = summed = peak = 0.0
        count = tokens = 0
        units: set[str] = set()
        sums: dict[str, float] = defaultdict(float)
        if idle.batch_size[0]:
            result = loss_fn(ModelOutput(logprobs=idle["logprobs"]), MicroBatch.of(idle))
            summed, peak = float(result.normalizer), float(result.normalizer)
            units.add(result.unit)
        plan = self._plan(mini)
        for i, mb_rows in enumerate(plan):
            if hold and i == len(plan) - 1:  # its backward reduces the step's gradients
                self.model.set_requires_gradient_sync(True)
                self.model.set_reshard_after_backward(True)
            if not mb_rows:
                self._dummy_pass(backward=True)
                continue
            mb = _trim(mini[torch.tensor(mb_rows)])
            result = loss_fn(self.outputs(mb, entropy), MicroBatch.of(mb.to(self.device)))
            result.loss_sum.backward()
            loss_sum += float(result.loss_sum.detach())
            summed += float(result.normalizer)
            peak = max(peak, float(result.normalizer))
            units.add(result.unit)
            for key, value in result.stats.items():
                sums[key] += float(value)
            count += 1
            tokens += int(mb["attention_mask"].sum())
        totals = StepTotals(loss_sum=loss_sum, normalizer=summed, micro_batches=count,
                            skipped_rows=idle.batch_size[0], tokens=tokens).summed_over_ranks()
        # units summed over micro-batches and ranks (tokens, sequences), constant units: seen on
        # any rank, so that every rank takes the same decision below (a rank with only dummy
        # passes has none)
        flags = torch.tensor([peak, bool(units - {"constant"}), "constant" in units],
                             dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1] > 0 and flags[2] > 0:
            raise ValueError("the loss returned both summed (tokens, sequences) and constant "
                             "normalizer units in one optimizer step: they cannot be combined")
        if totals.micro_batches + totals.skipped_rows == 0:  # no rank has a row: AdamW would
            # move on momentum alone
            return {"skipped_step": 1.0, "lr": self.scheduler.get_last_lr()[0]}
        # tokens and sequences add up over micro-batches and ranks; a constant is what it is
        total_norm = float(flags[0]) if flags[2] > 0 else totals.normalizer
        scale = self.world_size / total_norm if total_norm > 0 else 0.0
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
            elif p.requires_grad and totals.micro_batches == 0:  # only skipped rows: the zero
                p.grad = torch.zeros_like(p)  # gradient they would give
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   self.config.optim.max_grad_norm)
        grad_norm = float(_full(grad_norm))
        loss = totals.loss_sum / total_norm if total_norm > 0 else 0.0
        skipped = not (math.isfinite(grad_norm) and math.isfinite(loss))
        if skipped:
            problem = f"optimizer step {self.steps + 1}: loss {loss:g}, gradient norm {grad_norm:g}"
            if not self.config.skip_nonfinite:
                raise FloatingPointError(f"{problem} (pass --train.skip-nonfinite to skip such "
                                         "steps instead)")
            warnings.warn(f"{problem}: step skipped", RuntimeWarning, stacklevel=2)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            if self._readers is not None:  # held until `sync_weights` gives it the new version
                self._readers.pause()
            self.optimizer.step()
            self.scheduler.step()
            self.steps += 1
        out = {"loss": loss,
               "grad_norm": grad_norm, "skipped_step": float(skipped),
               "lr": self.scheduler.get_last_lr()[0], "normalizer": total_norm,
               "train/skipped_rows": float(totals.skipped_rows),
               # through forward and backward, all ranks: what MFU counts (skipped rows are not)
               "train/tokens": float(totals.tokens),
               # packed micro-batches have no padding; how full their token budget is instead
               "train/micro_batches": float(totals.micro_batches),
               "train/mb_fill": totals.tokens / max(totals.micro_batches, 1)
               / self.config.max_tokens_per_mb}
        return out | {key: value / max(count, 1) for key, value in sums.items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients of the last step (every rank must call; all get them)."""
        return {name: _full(p.grad).detach().cpu().clone()
                for name, p in self.model.named_parameters() if p.grad is not None}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters on CPU, as copies (every rank must call; all get them)."""
        state = self._unsharded_state()
        return state if self.sharded else {name: t.clone() for name, t in state.items()}

    def _unsharded_state(self, adapter_only: bool = False) -> dict[str, torch.Tensor]:
        if adapter_only:
            from areal_flow.lora import is_adapter
        # unwrapped on CPU, these are the live weights: for consumers that copy them at once
        return {name: _full(t).detach().cpu() for name, t in self.model.state_dict().items()
                if not adapter_only or is_adapter(name)}

    # -- weight sync --------------------------------------------------------------------

    def sync_weights(self, pool: Any, version: int, *, folder: str | Path | None = None,
                     group: Any = None, bucket_bytes: int = 512 * 2**20) -> dict[str, float]:
        """Give rank 0's generation `pool` (None elsewhere) the weights as `version`; every rank
        calls. Sent over `group`, as a `folder`, or in memory; with LoRA only the adapter. An
        in-process engine may keep the live tensors (`WeightUpdate.live`), paused by each step
        until the next `sync_weights`: call it after every `train`. Returns timings and bytes."""
        start = time.perf_counter()
        if self.adapter is not None:
            from areal_flow.lora import is_adapter

            if group is not None:
                raise ValueError("LoRA adapters reach SGLang servers as a folder "
                                 "(/load_lora_adapter), not over a weight-update group: sync "
                                 "with folder=...")
        # With LoRA only the adapter moves, except to an in-process engine that can keep the
        # trainer's own tensors (`WeightUpdate.live`): it takes them all once, and then nothing.
        live = self.shares_live_tensors and folder is None
        # every consumer below copies or writes the tensors before training goes on
        state = self._unsharded_state(adapter_only=self.adapter is not None and not live)
        gathered = time.perf_counter()
        # what the pool copies: an in-process engine that cannot keep the live tensors of a
        # LoRA model takes only the adapter from them; a tied tensor counts once
        sent = sum(t.numel() * t.element_size() for t in {
            t.data_ptr(): t for name, t in state.items()
            if self.adapter is None or is_adapter(name)}.values())
        if self.rank == 0:
            if group is not None:
                from areal_flow.runtime.weight_sync import broadcast_buckets

                broadcast_buckets(pool, group, state.items(), version=version,
                                  bucket_bytes=bucket_bytes)
            elif folder is not None:
                from areal_flow.runtime.weight_sync import update_from_folder

                update_from_folder(pool, Path(folder), version, state, model=self.model,
                                   adapter=self.adapter)
            else:
                kept = pool.update_weights(WeightUpdate(version=version, state_dict=state,
                                                        live=live, lora=self.adapter))
                if self._readers is not None:  # paused by the optimizer step
                    self._readers.resume()
                self._readers = pool if kept else None
                sent = 0 if kept else sent  # kept: nothing was copied
        dist.barrier()
        return {"sync/gather_seconds": gathered - start,
                "sync/send_seconds": time.perf_counter() - gathered,
                "sync/bytes": float(sent)}

    # -- micro-batches -----------------------------------------------------------------

    def _plan(self, batch: TensorDict) -> list[list[int]]:
        """This rank's micro-batches, as many on every rank (empty: dummy passes) for FSDP."""
        lengths = batch["attention_mask"].sum(-1).tolist()
        bins = micro_batches(lengths, self.config.max_tokens_per_mb)
        count = torch.tensor([len(bins)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        bins = split_to_count(bins, lengths, int(count))
        return [sorted(b) for b in bins] + [[] for _ in range(int(count) - len(bins))]

    def _dummy_pass(self, backward: bool) -> None:
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        inputs = PackedRows.of(ids, torch.ones_like(ids)).model_inputs()
        with torch.set_grad_enabled(backward):
            out = self.model(**inputs) if self.value else self.model(**inputs).logits
            if backward:
                (out.float().sum() * 0.0).backward()


def _glibc(function: str, *args: int) -> None:
    """Call glibc's allocator `function`; another C library keeps its own policy."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        getattr(ctypes.CDLL("libc.so.6"), function)(*args)


def _return_freed_memory() -> None:
    """Give freed blocks of 1 MiB+ back to the OS at once: glibc's growing mmap threshold would
    otherwise keep a step's freed activations resident (benchmarks/train_step.py)."""
    _glibc("mallopt", -3, 2**20)  # M_MMAP_THRESHOLD


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor (gathered from every rank); a plain tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _trim(mb: TensorDict) -> TensorDict:
    """Drop padding columns no row of this micro-batch uses (rows are right-padded)."""
    width = int(mb["attention_mask"].sum(-1).max())
    return mb.apply(lambda t: t[:, :width] if t.dim() > 1 else t, batch_size=mb.batch_size)
