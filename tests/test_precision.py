"""`runtime/precision.py`: the run's dtype chosen by timing a GEMM of the model's own shapes."""

from __future__ import annotations

import attrs
import pytest
import torch

from areal_flow.runtime import precision
from areal_flow.runtime.precision import choose


@pytest.mark.parametrize(("fp32", "bf16", "expected"), [
    (10e-3, 1e-3, "bfloat16"),   # AMX: bf16 10x faster
    (2e-3, 1.5e-3, "bfloat16"),  # 1.33x: pays
    (2e-3, 1.8e-3, "float32"),   # 1.11x: a near tie stays fp32
    (1e-3, 150e-3, "float32"),   # AVX2-only: emulated bf16
])
def test_auto_takes_bf16_only_where_it_is_clearly_faster(monkeypatch, tiny_model_dir, fp32, bf16,
                                                         expected):
    seen = []

    def seconds(shape, device, budget=0.3, packed=False):
        seen.append(shape)
        return {"float32": fp32, "bfloat16": bf16}

    monkeypatch.setattr(precision, "_seconds", seconds)
    monkeypatch.setattr(precision, "_measured", {})
    chosen = choose("auto", tiny_model_dir, purpose="train")
    assert chosen.dtype == expected
    assert chosen.seconds == {"float32": fp32, "bfloat16": bf16}
    # the model's own shapes: the tiny model's hidden size 96 by its MLP width 192
    assert seen == [(precision.ROWS["train"], 96, 192, 1)]
    assert expected in chosen.describe() and "measured" in chosen.describe()


def test_a_process_measures_each_shape_once_and_decode_probes_its_own_rows(monkeypatch,
                                                                           tiny_model_dir):
    calls = []
    monkeypatch.setattr(precision, "_seconds", lambda shape, device, budget=0.3, packed=False:
                        calls.append((shape, packed)) or {"float32": 1e-3, "bfloat16": 1e-3})
    monkeypatch.setattr(precision, "_measured", {})
    for _ in range(3):
        choose("auto", tiny_model_dir, purpose="train")
    choose("auto", tiny_model_dir, purpose="decode")
    # decode multiplies its 16 rows by one weight per layer (2 in the tiny model): read, not
    # cached; its weights packed as the engine packs them, where it does
    assert calls == [((256, 96, 192, 1), False), ((16, 96, 192, 2), True)]


def test_the_decode_probe_reads_weights_packed_as_the_engine_does(monkeypatch):
    """Unpacked, a product re-lays its weight out on every call: the probe then took bf16 for
    slower than fp32 on a CPU where the engine's packed bf16 decodes twice as fast; fp32 is
    packed where the engine packs it (`packed_weights.fp32_pays`)."""
    from areal_flow.inference import packed_weights

    fp32_packs = packed_weights.fp32_pays(96, 192, 3)  # timed (with the real products) first
    packed = []
    real = packed_weights.linear
    monkeypatch.setattr(packed_weights, "linear",
                        lambda weight, bias=None: packed.append(weight) or real(weight, bias))
    seconds = precision._seconds((16, 96, 192, 3), torch.device("cpu"), packed=True)
    expected = [dtype for dtype in (torch.float32, torch.bfloat16)
                if packed_weights.available(dtype, torch.device("cpu"))
                and (dtype == torch.bfloat16 or fp32_packs)]
    assert [(w.dtype, tuple(w.shape)) for w in packed] == [
        (dtype, (192, 96)) for dtype in expected for _ in range(3)]
    assert set(seconds) == {"float32", "bfloat16"} and min(seconds.values()) > 0


def test_a_given_dtype_or_a_gpu_is_never_measured(monkeypatch, tiny_model_dir):
    def never(*args, **kwargs):
        raise AssertionError("measured")

    monkeypatch.setattr(precision, "_seconds", never)
    monkeypatch.setattr(precision, "_measured", {})
    assert choose("float32", tiny_model_dir, purpose="train").dtype == "float32"
    assert choose("bfloat16", tiny_model_dir, purpose="decode").describe() == \
        "bfloat16 (given, or a GPU)"
    assert choose("auto", tiny_model_dir, purpose="train", device="cuda").dtype == "bfloat16"


def test_bad_choices_are_refused_naming_the_allowed_ones(tiny_model_dir):
    with pytest.raises(ValueError, match=r"dtype must be one of auto, float32, bfloat16: 'fp16'"):
        choose("fp16", tiny_model_dir, purpose="train")
    with pytest.raises(ValueError, match=r"purpose must be one of train, decode: 'eval'"):
        choose("auto", tiny_model_dir, purpose="eval")


def test_a_large_models_probe_is_capped(monkeypatch, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_hidden_layers=32).save_pretrained(tmp_path)
    shapes = []
    monkeypatch.setattr(precision, "_seconds", lambda shape, device, budget=0.3, packed=False:
                        shapes.append(shape) or {"float32": 1e-3, "bfloat16": 1e-3})
    monkeypatch.setattr(precision, "_measured", {})
    choose("auto", tmp_path, purpose="train")
    choose("auto", tmp_path, purpose="decode")
    assert shapes == [(256, 2048, 2048, 1), (16, 2048, 2048, 16)]  # 16 x 16 MiB of fp32


def test_the_real_probe_takes_well_under_a_second_and_times_both(monkeypatch, tiny_model_dir):
    import time

    monkeypatch.setattr(precision, "_measured", {})
    start = time.perf_counter()
    chosen = choose("auto", tiny_model_dir, purpose="train")
    assert time.perf_counter() - start < 5  # generous: a loaded CI machine
    assert set(chosen.seconds) == {"float32", "bfloat16"} and min(chosen.seconds.values()) > 0


@attrs.frozen
class _Cfg:
    train: object
    inference: object


def test_the_recorded_config_holds_the_choices_not_auto(monkeypatch, tiny_model_dir):
    from areal_flow.config import InferenceConfig
    from areal_flow.runtime.engine import TrainConfig

    monkeypatch.setattr(precision, "_seconds",
                        lambda shape, device, budget=0.3, packed=False, dtypes=precision.DTYPES:
                        {"float32": 4e-3, "bfloat16": 1e-3})
    monkeypatch.setattr(precision, "_measured", {})

    class Trainer:
        precision = choose("auto", tiny_model_dir, purpose="train")
        device = torch.device("cpu")

    cfg = _Cfg(train=TrainConfig(dtype="auto"), inference=InferenceConfig(dtype="auto"))
    resolved, note = precision.measured(cfg, str(tiny_model_dir), ("train", Trainer()),
                                        ("critic", None), in_process=True)
    assert resolved.train.dtype == "bfloat16" and resolved.inference.dtype == "bfloat16"
    assert note.splitlines()[1:] == [
        "train.dtype: bfloat16, measured (float32 4.00 ms, bfloat16 1.00 ms for a 256x96x192 GEMM)",
        "train GEMM rate (MFU's denominator): 0.0755 TFLOP/s",  # 2 * 2048 * 96 * 192 / 1 ms
        "inference.dtype: bfloat16, measured (float32 4.00 ms, bfloat16 1.00 ms for a 16x96x192 "
        "GEMM with each of 2 weights)"]


def test_the_mfu_denominator_is_the_rate_in_the_dtype_in_use_over_a_micro_batch_of_rows(
        monkeypatch, tiny_model_dir):
    timed = []

    def seconds(shape, device, budget=0.3, packed=False, dtypes=precision.DTYPES):
        timed.append((shape, dtypes))
        return {name: {"float32": 4e-3, "bfloat16": 1e-3}[name] for name in dtypes}

    monkeypatch.setattr(precision, "_seconds", seconds)
    monkeypatch.setattr(precision, "_measured", {})
    flops = 2 * precision.RATE_ROWS["cpu"] * 96 * 192
    assert precision.gemm_rate(tiny_model_dir, "float32") == pytest.approx(flops / 4e-3)
    assert precision.gemm_rate(tiny_model_dir, "bfloat16") == pytest.approx(flops / 1e-3)
    assert precision.gemm_rate(tiny_model_dir, "float32") == pytest.approx(flops / 4e-3)
    # each dtype timed alone (a forced, emulated bf16 would slow an fp32 run's), once
    assert timed == [((2048, 96, 192, 1), ("float32",)), ((2048, 96, 192, 1), ("bfloat16",))]



def test_the_mfu_denominator_is_timed_at_start_not_beside_the_running_engine(
        monkeypatch, tiny_model_dir):
    """Timed at the first step, beside an engine decoding on the same cores, fp32's rate read
    0.136 TFLOP/s against 0.39 quiet, and a reasoning-gym run's MFU 123 %: `measured`, which the
    recipe calls before anything else runs, times it, and the steps reuse that timing."""
    from areal_flow.config import InferenceConfig
    from areal_flow.runtime.engine import TrainConfig

    calls = []
    monkeypatch.setattr(precision, "_seconds",
                        lambda shape, device, budget=0.3, packed=False, dtypes=precision.DTYPES:
                        calls.append(shape) or {name: 1e-3 for name in dtypes})
    monkeypatch.setattr(precision, "_measured", {})

    class Trainer:
        precision = choose("float32", tiny_model_dir, purpose="train")
        device = torch.device("cpu")

    cfg = _Cfg(train=TrainConfig(dtype="float32"), inference=InferenceConfig(dtype="float32"))
    precision.measured(cfg, str(tiny_model_dir), ("train", Trainer()))
    timed_at_start = len(calls)
    assert timed_at_start == 1
    precision.gemm_rate(tiny_model_dir, "float32", "cpu")  # as `TrainEngine.mfu` at a step
    assert len(calls) == timed_at_start


def test_the_probe_multiplies_into_one_output_not_a_fresh_tensor_per_call(monkeypatch):
    """With the trainer's 1 MiB mmap threshold (`engine._return_freed_memory`) a fresh output per
    GEMM faulted its pages in on every call: bf16's rate read 1.08 TFLOP/s beside a live
    trainer, 2.5 without it, and MFU over it twice the truth."""
    outputs = []
    real_mm = torch.mm

    def mm(x, mat2, out=None):
        outputs.append(out)
        return real_mm(x, mat2, out=out)

    monkeypatch.setattr(torch, "mm", mm)
    precision._seconds((64, 32, 48, 2), torch.device("cpu"), budget=0.01)
    assert outputs and all(out is not None for out in outputs)
    assert len({id(out) for out in outputs}) == 2 * 2  # one per weight and dtype


class _Clock:
    """A device on a fake clock: a GEMM costs `launch` seconds plus its FLOPs at `rate`, a
    synchronize `sync` seconds (an H100: about 5 µs to launch, tens of µs to synchronize)."""

    def __init__(self, monkeypatch, rate=1e12, launch=0.0, sync=50e-6):
        self.now, self.rate, self.launch, self.cost = 0.0, rate, launch, sync
        monkeypatch.setattr(precision, "time", type("T", (), {"perf_counter": self.read}))
        monkeypatch.setattr(torch, "mm", self.mm)
        monkeypatch.setitem(precision.SYNCHRONIZE, "cpu", self.sync)
        monkeypatch.setattr(precision, "_measured", {})

    def read(self):
        return self.now

    def mm(self, x, mat2, out=None):
        self.now += self.launch + 2 * x.shape[0] * x.shape[1] * mat2.shape[1] / self.rate
        return out

    def sync(self):
        self.now += self.cost


def test_what_a_timing_costs_once_is_not_counted_as_gemm_time(monkeypatch):
    """Timed once, a GEMM a GPU finishes in microseconds read as a fraction of the device's rate
    (its synchronize counted as work): an H100's MFU then read 16.6 %."""
    clock = _Clock(monkeypatch, rate=1e12, sync=50e-6)
    seconds = precision._seconds((256, 96, 192, 1), torch.device("cpu"))
    flops = 2 * 256 * 96 * 192
    assert flops / seconds["float32"] == pytest.approx(clock.rate, rel=0.05)
    assert flops / seconds["bfloat16"] == pytest.approx(clock.rate, rel=0.05)


@pytest.mark.parametrize(("device", "launch"), [("cuda", 5e-6), ("cpu", 5e-6)])
def test_a_device_that_loses_time_per_gemm_gets_a_micro_batch_of_rows(
        monkeypatch, tiny_model_dir, device, launch):
    """MFU's denominator: over 256 rows of the tiny model's shapes a fixed cost per GEMM (a GPU's
    launch, a CPU's thread hand-off and packing) hides the rate (an H100 read a twentieth of
    its peak; fp32 on an AMX Xeon a third, and a run's MFU 123 %); a micro-batch of rows
    reaches it."""
    clock = _Clock(monkeypatch, rate=1e12, launch=launch)
    monkeypatch.setitem(precision.RATE_ROWS, "cpu", precision.RATE_ROWS[device])
    assert precision.gemm_rate(tiny_model_dir, "float32") == pytest.approx(clock.rate, rel=0.1)

@pytest.mark.parametrize(("rollouts", "train", "chosen"), [
    ("bfloat16", "float32", "tis"),  # bf16 rollouts' log-probs differ from fp32 training's
    ("float32", "float32", "none"),
    ("bfloat16", "bfloat16", "none"),
    ("float32", "bfloat16", "none"),
    (None, "float32", "tis"),  # servers that choose their own precision
    (None, "bfloat16", "tis"),  # (fp8, say): unknown is corrected, at no cost where equal
])
def test_auto_turns_tis_on_where_rollouts_are_narrower_than_training(rollouts, train, chosen):
    from areal_flow.config import PolicyLossConfig

    loss = PolicyLossConfig(eps_clip=0.3)
    assert loss.mismatch_correction == "auto"  # the default
    settled = precision.mismatch_default(loss, rollouts, train)
    assert settled.mismatch_correction == chosen and settled.eps_clip == 0.3
    explicit = PolicyLossConfig(mismatch_correction="token_mask")
    assert precision.mismatch_default(explicit, rollouts, train) is explicit


@attrs.frozen
class _RLCfg:
    train: object
    inference: object
    algorithm: object


def test_the_recorded_config_holds_the_mismatch_correction_the_precisions_chose(
        monkeypatch, tiny_model_dir):
    from areal_flow.algorithms.grpo import GRPOConfig
    from areal_flow.config import InferenceConfig
    from areal_flow.runtime.engine import TrainConfig

    monkeypatch.setattr(precision, "_seconds",
                        lambda shape, device, budget=0.3, packed=False, dtypes=precision.DTYPES:
                        {"float32": 4e-3, "bfloat16": 1e-3})
    monkeypatch.setattr(precision, "_measured", {})

    class Trainer:
        precision = choose("float32", tiny_model_dir, purpose="train")
        device = torch.device("cpu")

    cfg = _RLCfg(train=TrainConfig(dtype="float32"), inference=InferenceConfig(dtype="auto"),
                 algorithm=GRPOConfig())
    resolved, note = precision.measured(cfg, str(tiny_model_dir), ("train", Trainer()),
                                        in_process=True)
    assert resolved.inference.dtype == "bfloat16"
    assert resolved.algorithm.loss.mismatch_correction == "tis"
    assert note.splitlines()[-1] == ("algorithm.loss.mismatch_correction: tis (auto: rollouts "
                                     "in bfloat16, training in float32)")
    same = attrs.evolve(cfg, inference=InferenceConfig(dtype="float32"))
    resolved, _ = precision.measured(same, str(tiny_model_dir), ("train", Trainer()),
                                     in_process=True)
    assert resolved.algorithm.loss.mismatch_correction == "none"
