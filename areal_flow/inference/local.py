"""The local engine: a transformers causal LM generating in-process, with continuous batching.

One thread owns the model and a left-padded KV cache, decoding a token per running row each step;
`pause()` requeues running requests, re-prefilled after `resume()` (tokens keep their versions)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import inspect
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from os.path import commonprefix
from pathlib import Path
from typing import Literal

import attrs
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_flow.inference import decode_step, packed_weights
from areal_flow.inference import grouped_attention as grouped_attention_module
from areal_flow.inference.engine_weights import EngineWeights
from areal_flow.inference.kv_batch import KVBatch, left_padded, positions
from areal_flow.inference.sampling import sample
from areal_flow.types import Completion, FinishReason, GenerationRequest, WeightUpdate
from areal_flow.runtime.precision import choose, read_bandwidth


def resolve_device(device: str) -> torch.device:
    """``"auto"`` is CUDA when a GPU is visible, else the CPU; anything else is a torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _set_thread_pool_size(threads: int) -> None:
    """Set this thread's OpenMP pool only (torch.set_num_threads would set the trainer's too)."""
    torch.get_num_threads()  # torch's lazy per-thread init first, or it would undo the setting
    try:
        ctypes.CDLL(None).omp_set_num_threads(threads)
    except AttributeError:  # a torch without OpenMP: say so rather than ignore the setting
        warnings.warn(f"the local engine's threads={threads} has no effect: this torch has no "
                      "OpenMP runtime to give its thread a pool of its own", stacklevel=1)


@attrs.define(eq=False)
class _Sequence:
    request: GenerationRequest
    future: concurrent.futures.Future
    generator: torch.Generator | None
    serial: int
    """Submission order: an abort applies to requests submitted before it, never after."""
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)


class LocalEngine:
    """In-process `GenerationPool` over a Hugging Face causal LM (CPU or one GPU).

    Args:
        model: a `save_pretrained` folder (or hub id when online).
        dtype: weights' dtype, or "auto": the faster for this model here (`runtime/precision.py`).
        device: torch device, or ``"auto"`` (CUDA when available, else CPU).
        max_batch_size: most sequences decoded together; more wait in a queue.
        seed: seeds the sampling of requests without a seed of their own.
        threads: intra-op threads of the engine thread (None: torch's default).
        share_prefix, kv_slots, pack_weights, grouped_attention, fused_decode: speed-ups, off
            only for comparisons (a group's prompt prefilled once; `kv_batch`, `packed_weights`,
            `grouped_attention`, `decode_step`: 1.06x in bf16). pack_weights None: where
            `packed_weights.pays` (fp32: timed); True: wherever oneDNN packs the dtype."""

    def __init__(self, model: str | Path, *,
                 dtype: Literal["auto", "float32", "bfloat16"] = "float32", device: str = "cpu",
                 max_batch_size: int = 64, seed: int = 0, version: int = 0,
                 share_prefix: bool = True, threads: int | None = None, kv_slots: bool = True,
                 pack_weights: bool | None = None, grouped_attention: bool = True,
                 fused_decode: bool = True):
        if max_batch_size < 1:
            raise ValueError(f"'max_batch_size' must be >= 1: {max_batch_size}")
        if threads is not None and threads < 1:
            raise ValueError(f"'threads' must be >= 1 or None (torch's default): {threads}")
        self.threads = threads
        self.model_path = str(model)
        self.device = resolve_device(device)
        self.precision = choose(dtype, self.model_path, purpose="decode", device=self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.precision.torch_dtype, attn_implementation="sdpa"
        ).to(self.device).eval()
        # transformers 5.24 renamed the KV cache argument and output `past_key_values` to
        # `cache` (the old name warns, and goes in 5.40); earlier 5.x know only the old one
        self._cache = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"
        self.max_batch_size = max_batch_size
        self.share_prefix = share_prefix
        self.pack_weights = pack_weights is not False and packed_weights.available(
            self.model.dtype, self.device) and (pack_weights or packed_weights.pays(self.model))
        self.grouped_attention = grouped_attention and \
            grouped_attention_module.available(self.model, self.device)
        if self.grouped_attention:
            grouped_attention_module.use(self.model)
        # reads the model's modules as they are at each step: updates and adapters apply
        self._decode_step = decode_step.DecodeStep(self.model, rows=min(max_batch_size, 16)) \
            if fused_decode and decode_step.supports(self.model, self.device) else None
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        # what a decode step must read at least (tied tensors once), and how fast it can be read
        self.weight_bytes = sum({t.data_ptr(): t.numel() * t.element_size()
                                 for t in self.model.state_dict().values()}.values())
        self.read_bandwidth = read_bandwidth(self.device)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = {t for t in [*eos, self.tokenizer.eos_token_id] if t is not None}
        self.pad_token_id = self.tokenizer.pad_token_id or next(iter(self.eos_token_ids), 0)
        self._rng = torch.Generator().manual_seed(seed)
        self.weights = EngineWeights(self.model, version=version, pack=self.pack_weights)

        self._cv = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        # request id (None: every request) -> last submission serial the abort applies to
        self._abort: dict[str | None, int] = {}
        self._submitted = 0
        self._paused = False
        self._stepping = False
        """A forward pass is in flight (the stepping thread is outside the lock)."""
        self._closing = False
        self._hosted = False
        # Owned by the thread that steps (the engine thread, or the caller within `hosted`):
        self._running: list[_Sequence] = []
        self._kv = KVBatch(self.model.config, slots=kv_slots)
        self._totals = _Counters()
        self._reported = (time.perf_counter(), _Counters())
        self.on_step: Callable[[LocalEngine], None] | None = None
        """Called on the engine thread after every batch step (tests and instrumentation)."""
        self._start_thread()

    in_process = True

    @classmethod
    def from_config(cls, config, *, model: str, seed: int = 0, run_dir=None,
                    lora=None) -> LocalEngine:
        """See `GenerationPool.from_config`; LoRA adapter layers come with the first update."""
        return cls(model, dtype=config.dtype, device=config.device,
                   max_batch_size=config.max_batch_size, seed=seed, threads=config.threads)

    # -- GenerationPool -----------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.weights.version

    async def generate(self, request: GenerationRequest) -> Completion:
        seq = self.submit(request)
        try:
            return await asyncio.wrap_future(seq.future)
        except asyncio.CancelledError:
            self.abort(request.rid)
            raise

    def submit(self, request: GenerationRequest) -> _Sequence:
        """Queue `request` (`.future` gives its `Completion`); ValueError now if it cannot run."""
        for field, ids in (("input_ids", request.input_ids),
                           ("stop_token_ids", request.sampling.stop_token_ids)):
            if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):  # C speed, each call
                bad = next(i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
                raise ValueError(f"'{field}' holds token id {ids[bad]} at position {bad}, outside "
                                 f"the model's vocabulary [0, {self.vocab_size})")
        total = len(request.input_ids) + request.sampling.max_new_tokens
        if self.max_length is not None and total > self.max_length:
            raise ValueError(f"prompt of {len(request.input_ids)} tokens + max_new_tokens "
                             f"{request.sampling.max_new_tokens} exceeds the model's "
                             f"{self.max_length} positions")
        seed = request.sampling.seed
        if seed is None and not request.sampling.greedy:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        with self._cv:
            if self._closing:
                raise RuntimeError("the local engine is closed")
            self._submitted += 1
            seq = _Sequence(request=request, future=concurrent.futures.Future(),
                            generator=generator, serial=self._submitted)
            self._waiting.append(seq)
            self._cv.notify_all()
        return seq

    def abort(self, rid: str | None = None) -> None:
        """Cancel `rid` (None: all): it returns at once, ``abort``, with its tokens so far."""
        with self._cv:
            self._abort[rid] = self._submitted
            self._cv.notify_all()

    def pause(self, wait: bool = True) -> None:
        """Hold requests until `resume`; running rows go back to the queue, to be re-prefilled
        under the weights of then. `wait`: until no forward runs, the rows requeued on return
        (also by the thread hosting the steps, between them); else at the next step."""
        with self._cv:
            self._paused = True
            self._cv.notify_all()
            if wait:
                self._cv.wait_for(lambda: not self._stepping)
                self._requeue_locked()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def set_version(self, version: int) -> None:
        """Relabel the loaded weights for new tokens (SGLang's `/update_weight_version`)."""
        self.weights.relabel(version)

    def update_weights(self, update: WeightUpdate) -> bool:
        """Load a state dict or folder. Bucketed: calls keeping the version accumulate; the one
        changing it must complete the tensors (else ValueError). A `live` update matching the
        engine's dtype and device is kept, not copied (True); its owner pauses the engine first."""
        with self._paused_for_change():
            return self.weights.update(update)

    def remove_adapter(self) -> None:
        """Serve the base model: zero the adapter's B matrices (its layers stay for the next)."""
        with self._paused_for_change():
            self.weights.remove_adapter()

    @contextlib.contextmanager
    def _paused_for_change(self):
        was_paused = self._paused
        self.pause()
        try:
            yield
        finally:
            if not was_paused:
                self.resume()

    def memory_gb(self) -> float:
        """GB held beyond the trainer's weights: own copy (none if `live`) plus packed copies."""
        packed = sum(m.weight.numel() * m.weight.element_size() for m in self.model.modules()
                     if type(m) is torch.nn.Linear and "forward" in m.__dict__)
        return ((0 if self.weights.shared else self.weight_bytes) + packed) / 2**30

    def kv_cache_gb(self) -> float:
        """GB the running (or paused) rows' KV cache holds now."""
        return self._kv.nbytes() / 2**30

    def stats(self) -> dict[str, float]:
        """Counters since the last call, plus current queue sizes."""
        # The engine thread only ever increments `_totals`; reporting differences of snapshots
        # needs no lock on the hot path.
        now, totals = time.perf_counter(), attrs.evolve(self._totals)
        (then, before), self._reported = self._reported, (now, totals)
        delta = {f.name: getattr(totals, f.name) - getattr(before, f.name)
                 for f in attrs.fields(_Counters)}
        seconds = delta.pop("decode_seconds")
        return {
            **delta,
            "tokens_per_s": delta["generated_tokens"] / max(now - then, 1e-9),
            # the weight-read bound over the measured step: the fraction of the memory bandwidth
            # decoding reaches (sampling and stop checks included in the step)
            "decode_mbu": (self.weight_bytes * delta["decode_steps"] / self.read_bandwidth
                           / seconds) if delta["decode_steps"] else 0.0,
            "running": len(self._running),
            "queued": len(self._waiting),
        }

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        with self._cv:
            for seq in [*self._waiting, *self._running]:
                _settle(seq.future, RuntimeError("the local engine was closed"))
            self._waiting.clear()

    @contextlib.contextmanager
    def hosted(self):
        """Within: the caller (e.g. a trainer awaiting its batch) runs the steps via `step`, since
        libgomp throttles teams outnumbering CPUs: the engine thread's decoded 1.6-1.8x slower
        (bf16, 2 CPUs, benchmarks/decode.py "hosted"). The engine thread restarts after."""
        with self._cv:
            if self._hosted:
                raise RuntimeError("the local engine's steps are hosted by another caller already")
            self._hosted = True
            self._cv.notify_all()
        self._thread.join()  # after the step it is in, if any
        try:
            yield self
        finally:
            with self._cv:
                self._hosted = False
                if not self._closing:
                    self._start_thread()

    def step(self, timeout: float) -> None:
        """One engine step within `hosted()`; waits up to `timeout` seconds for work."""
        if not self._hosted:
            raise RuntimeError("LocalEngine.step runs only within LocalEngine.hosted()")
        self._step(timeout, background=False)

    # -- the engine thread --------------------------------------------------------------

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="local-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self.threads is not None:
            _set_thread_pool_size(self.threads)
        while self._step(timeout=None, background=True):
            pass

    def _step(self, timeout: float | None, background: bool) -> bool:
        """Wait up to `timeout` (None: ever) for work, prefill, decode; False: the thread stops."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._drain_aborts_locked()
            if self._paused:  # by `pause(wait=False)` during the last step
                self._requeue_locked()
            while (stop := self._closing or (background and self._hosted)) or (
                    self._paused or not (self._waiting or self._running)):
                remaining = None if deadline is None else deadline - time.monotonic()
                if stop or (remaining is not None and remaining <= 0):
                    return not stop
                self._cv.wait(remaining)
                self._drain_aborts_locked()
            self._stepping = True
            room = self.max_batch_size - len(self._running)
            admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        try:
            with torch.inference_mode():
                if admitted:
                    self._prefill(admitted)
                if self._running:
                    self._decode()
            if self.on_step is not None:
                self.on_step(self)
        except Exception as exc:  # fail the affected requests instead of hanging them
            self._fail_running([*admitted, *self._running], exc)
        finally:
            with self._cv:
                self._stepping = False
                self._cv.notify_all()
        return True

    def _requeue_locked(self) -> None:
        """Running rows back to the head of the queue, their KV cache dropped: re-prefilled from
        prompt + tokens so far on `resume`. Only while no forward runs."""
        if self._running:
            self._totals.interruptions += len(self._running)
            self._waiting.extendleft(reversed(self._running))
            self._keep([])

    def _fail_running(self, seqs: list[_Sequence], exc: Exception) -> None:
        """Fail `seqs`; empty the running batch, which a failure left in no known state."""
        for seq in seqs:
            _settle(seq.future, exc)
        self._running = []
        self._kv.clear()  # not `_keep`, which may be what failed

    def _drain_aborts_locked(self) -> None:
        if not self._abort:
            return
        def cancelled(seq: _Sequence) -> bool:
            upto = max(self._abort.get(None, 0), self._abort.get(seq.request.rid, 0))
            return seq.serial <= upto or seq.future.done()

        dropped = [s for s in [*self._waiting, *self._running] if cancelled(s)]
        self._waiting = deque(s for s in self._waiting if not cancelled(s))
        kept = [i for i, s in enumerate(self._running) if not cancelled(s)]
        self._abort.clear()
        if len(kept) < len(self._running):
            survivors = [self._running[i] for i in kept]
            try:
                self._keep(kept)
            except Exception as exc:  # outside the step's handler: the engine thread lives on
                self._fail_running(survivors, exc)
        for seq in dropped:
            self._finish(seq, "abort")

    def _prefill(self, admitted: list[_Sequence]) -> None:
        """Prefill a same-prompt group's common context once, copied per request; then the rest."""
        contexts = [[*seq.request.input_ids, *seq.tokens] for seq in admitted]
        groups: dict[object, list[int]] = {}
        for i, seq in enumerate(admitted):
            groups.setdefault(seq.request.input_ids if self.share_prefix else i, []).append(i)
        members = list(groups.values())
        group = {i: g for g, rows in enumerate(members) for i in rows}
        prefixes = [commonprefix([contexts[i] for i in rows]) for rows in members]  # any sequences
        cut = [len(prefixes[group[i]]) for i in range(len(admitted))]
        ids, mask = left_padded(prefixes, self.pad_token_id, self.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                         use_cache=True, logits_to_keep=1)  # only the last position samples
        prefilled = getattr(out, self._cache)
        whole = [i for i, c in enumerate(contexts) if len(c) == cut[i]]
        rest = [i for i, c in enumerate(contexts) if len(c) > cut[i]]
        logits = []
        if whole:  # the prefix is the whole context: copy its row and logits for each request
            rows = [group[i] for i in whole]
            joined = (prefilled, mask) if rows == list(range(len(prefixes))) else \
                self._kv.rows(prefilled, mask, rows)
            self._join(*joined, [admitted[i] for i in whole])
            logits.append(out.logits[rows, -1])
        suffixes = [contexts[i][cut[i]:] for i in rest]
        if rest:  # the rest of each context runs after a copy of its group's prefix rows
            cache, prefix_mask = self._kv.rows(prefilled, mask, [group[i] for i in rest])
            ids, suffix_mask = left_padded(suffixes, self.pad_token_id, self.device)
            # left padding of the suffixes leaves masked columns between prefix and suffix
            mask = torch.cat([prefix_mask, suffix_mask], dim=1)
            out = self.model(input_ids=ids, attention_mask=mask,
                             position_ids=positions(mask)[:, -ids.shape[1]:],
                             **{self._cache: cache}, use_cache=True, logits_to_keep=1)
            self._join(getattr(out, self._cache), mask, [admitted[i] for i in rest])
            logits.append(out.logits[:, -1])
        ran = sum(map(len, prefixes)) + sum(map(len, suffixes))
        self._totals.prefill_tokens += ran
        self._totals.prefill_shared_tokens += sum(map(len, contexts)) - ran
        # a request with tokens already was interrupted: its context is prefilled again (only
        # such requests have a suffix: their group's prefix holds at least the prompt)
        self._totals.reprefill_tokens += sum(map(len, suffixes)) + sum(
            len(p) for p, rows in zip(prefixes, members) if any(admitted[i].tokens for i in rows))
        self._sample_and_advance(torch.cat(logits), first_row=len(self._running) - len(admitted))

    def _decode(self) -> None:
        started = time.perf_counter()
        last = torch.tensor([[seq.tokens[-1]] for seq in self._running], device=self.device)
        mask, position_ids = self._kv.next_column()
        if self._decode_step is not None:
            logits = self._decode_step(last, position_ids, mask, self._kv.cache)
        else:
            out = self.model(input_ids=last, attention_mask=mask, position_ids=position_ids,
                             **{self._cache: self._kv.cache}, use_cache=True)
            self._kv.cache, logits = getattr(out, self._cache), out.logits[:, -1]
        self._sample_and_advance(logits, first_row=0, decode_started=started)

    def _sample_and_advance(self, logits: torch.Tensor, first_row: int,
                            decode_started: float | None = None) -> None:
        """Sample a token for rows from `first_row` on; retire finished rows after stats count."""
        rows = self._running[first_row:]
        tokens, logprobs = sample(logits, [s.request.sampling for s in rows],
                                  [s.generator for s in rows])
        version = self.weights.version
        for seq, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
        self._totals.generated_tokens += len(rows)
        keep, done = [], []
        for i, seq in enumerate(self._running):
            sp = seq.request.sampling
            last = seq.tokens[-1]
            if last in sp.stop_token_ids or (last in self.eos_token_ids and not sp.ignore_eos):
                done.append((seq, "stop"))
            elif len(seq.tokens) >= sp.max_new_tokens:
                done.append((seq, "length"))
            else:
                keep.append(i)
        if decode_started is not None:
            self._totals.decode_steps += 1
            self._totals.decode_seconds += time.perf_counter() - decode_started
        if done:
            self._keep(keep)  # leave the batch before the caller hears, so stats() agree
            for seq, reason in done:
                self._finish(seq, reason)

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        if seq.future.done():
            return
        try:
            text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        except Exception as exc:  # this request's failure: not the batch's, not the thread's
            _settle(seq.future, exc)
            return
        self._totals.finished += 1
        _settle(seq.future, Completion(
            token_ids=seq.tokens, logprobs=seq.logprobs, versions=seq.versions,
            finish_reason=reason, temperature=seq.request.sampling.logprob_temperature,
            text=text))

    # -- the running batch ---------------------------------------------------------------

    def _join(self, cache, mask: torch.Tensor, admitted: list[_Sequence]) -> None:
        self._kv.append(cache, mask)
        # lists are replaced, never mutated: abort() may read them from another thread
        self._running = [*self._running, *admitted]

    def _keep(self, rows: list[int]) -> None:
        self._running = [self._running[i] for i in rows]
        self._kv.keep(rows)


def _settle(future: concurrent.futures.Future, outcome: object) -> None:
    """Resolve `future` unless its caller already cancelled it."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


@attrs.define
class _Counters:
    """Totals of what `stats` reports (`decode_seconds` as part of `decode_mbu`)."""
    generated_tokens: int = 0
    prefill_tokens: int = 0
    """Context tokens run through the model to prefill (a shared prefix counts once)."""
    reprefill_tokens: int = 0
    """The part of `prefill_tokens` run again for interrupted requests."""
    prefill_shared_tokens: int = 0
    """Context tokens whose prefill was saved by sharing a prefix."""
    finished: int = 0
    interruptions: int = 0
    decode_steps: int = 0
    """Forward passes that decoded one token for every running row."""
    decode_seconds: float = 0.0
    """Their time, sampling and stop checks included."""
