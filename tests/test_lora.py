"""LoRA (`--train.lora.*`): only adapters train, checkpoint and travel, and whatever generates
afterwards (the local engine given the adapter in memory or as a PEFT folder, a protocol server
given it by /load_lora_adapter) computes what the trainer's merged model computes."""

from __future__ import annotations

import functools
import json
import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_flow.config import OptimizerConfig
from areal_flow.inference.local import LocalEngine
from areal_flow.lora import LoraConfig, is_adapter, load_adapter
from areal_flow.runtime import checkpoint
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.types import GenerationRequest, SamplingParams, WeightUpdate
from tests.dist_train_script import TokenNLL, fixed_batch
from tests.helpers import metrics, needs, run_recipe

pytestmark = needs("peft", "lora")

PROMPT = [5, 17, 42, 9, 3, 77]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def lora_trainer(model_dir, rank: int = 4) -> TrainEngine:
    torch.manual_seed(0)
    # a large step, so that the adapter visibly changes what the model computes
    return TrainEngine(model_dir, TrainConfig(optim=OptimizerConfig(lr=5e-2),
                                              lora=LoraConfig(rank=rank, alpha=8)))


@pytest.fixture(scope="module")
def trained(world, tiny_model_dir, tmp_path_factory):
    """A LoRA trainer after two optimizer steps, its base weights before them, and its
    `save_hf` export (merged weights + adapter/)."""
    trainer = lora_trainer(tiny_model_dir)
    base = {k: t.clone() for k, t in trainer.full_state_dict().items() if not is_adapter(k)}
    batch = fixed_batch(trainer.model.config.vocab_size)
    for _ in range(2):
        trainer.train(batch.clone(), TokenNLL())
    export = tmp_path_factory.mktemp("lora_export")
    checkpoint.save_hf(trainer, export, tokenizer_from=tiny_model_dir)
    return trainer, base, export


def greedy_reference(model_dir) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from transformers' own `generate` of a saved model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         min_new_tokens=NEW_TOKENS, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(PROMPT):].tolist()
    # the raw logits: generate's `scores` are after its logits processors
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, tokens)]
    return tokens, logprobs


def engine_greedy(engine: LocalEngine) -> tuple[list[int], list[float]]:
    request = GenerationRequest(input_ids=PROMPT, sampling=SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    completion = engine.submit(request).future.result(timeout=60)
    return list(completion.token_ids), list(completion.logprobs)


def test_only_the_adapter_trains(trained):
    trainer, base, _ = trained
    after = trainer.full_state_dict()
    assert set(base) == {k for k in after if not is_adapter(k)}
    for name, tensor in base.items():  # the frozen base is bit-for-bit what it was
        assert torch.equal(after[name], tensor), name
    moved = [k for k in after if ".lora_B." in k and after[k].abs().max() > 0]
    assert len(moved) == len([k for k in after if ".lora_B." in k]) > 0  # B starts at zero
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in trainer.model.named_parameters() if is_adapter(n)}


def test_the_export_is_the_merged_model_and_a_peft_adapter(trained, tiny_model_dir):
    import peft

    trainer, _, export = trained
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        live = trainer.model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(export).eval()(input_ids=ids).logits
        base_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        base = base_model(input_ids=ids).logits
        # the adapter folder, loaded by peft itself onto the base model
        adapted = peft.PeftModel.from_pretrained(base_model, export / "adapter").eval()
        via_peft = adapted(input_ids=ids).logits
    assert (live - base).abs().max() > 1e-2  # the adapter changes the model ...
    torch.testing.assert_close(merged, live, rtol=1e-4, atol=1e-4)  # ... and merging keeps it
    torch.testing.assert_close(via_peft, live, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", ["live", "in_memory", "folder"])
def test_after_lora_steps_the_engine_generates_what_the_merged_model_does(trained, tiny_model_dir,
                                                                          tmp_path, how):
    trainer, _, export = trained
    expected_tokens, expected_logprobs = greedy_reference(export)
    engine = LocalEngine(tiny_model_dir)
    try:
        if how == "live":  # the recipes' in-process path: the trainer's own tensors
            sync = trainer.sync_weights(engine, 3)
            assert sync["sync/bytes"] == 0 and engine.weights.shared
        elif how == "in_memory":
            adapter = {k: t.clone() for k, t in trainer.full_state_dict().items() if is_adapter(k)}
            engine.update_weights(WeightUpdate(version=3, state_dict=adapter,
                                               lora=trainer.adapter))
        else:  # what a server gets: the PEFT folder the trainer writes
            sync = trainer.sync_weights(engine, 3, folder=tmp_path / "adapter")
            adapter_bytes = sum(t.numel() * 4 for k, t in trainer.full_state_dict().items()
                                if is_adapter(k))
            assert sync["sync/bytes"] == adapter_bytes
            assert not list((tmp_path / "adapter").rglob("model.safetensors"))  # no base
        tokens, logprobs = engine_greedy(engine)
    finally:
        engine.close()
        trainer._readers = None
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


@pytest.mark.faults
def test_a_lora_policys_reference_is_its_own_base_model(trained, tiny_model_dir):
    """No second copy of the weights: the reference runs the policy with its adapter off, and
    the adapter is back on afterwards."""
    from areal_flow.runtime.roles import BaseModelRole

    trainer, _, _ = trained
    batch = fixed_batch(trainer.model.config.vocab_size)
    policy = trainer.forward(batch)["logprobs"]
    ref = trainer.reference(tiny_model_dir)
    assert isinstance(ref, BaseModelRole) and ref.engine is trainer
    base = TrainEngine(tiny_model_dir, TrainConfig(), trainable=False).forward(batch)["logprobs"]
    torch.testing.assert_close(ref.forward(batch)["logprobs"], base, rtol=1e-5, atol=1e-5)
    assert (policy - base).abs().max() > 1e-2  # the adapter matters, so the check above can fail
    torch.testing.assert_close(trainer.forward(batch)["logprobs"], policy, rtol=0, atol=0)
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if is_adapter(n))


def test_removing_the_adapter_serves_the_base_model_again(trained, tiny_model_dir):
    trainer, _, _ = trained
    expected = greedy_reference(tiny_model_dir)
    engine = LocalEngine(tiny_model_dir)
    try:
        adapter = {k: t.clone() for k, t in trainer.full_state_dict().items() if is_adapter(k)}
        engine.update_weights(WeightUpdate(version=1, state_dict=adapter, lora=trainer.adapter))
        adapted = engine_greedy(engine)
        engine.remove_adapter()
        assert not engine.paused  # it was running: it runs again
        tokens, logprobs = engine_greedy(engine)
    finally:
        engine.close()
    assert adapted[0] != expected[0]  # the adapter mattered, so the check below can fail
    assert tokens == expected[0] and logprobs == pytest.approx(expected[1], abs=1e-4)


def test_the_engine_refuses_an_adapter_that_does_not_fit(trained, tiny_model_dir):
    trainer, _, _ = trained
    engine = LocalEngine(tiny_model_dir)
    try:
        adapter = {k: t.clone() for k, t in trainer.full_state_dict().items() if is_adapter(k)}
        engine.update_weights(WeightUpdate(version=1, state_dict=adapter, lora=trainer.adapter))
        with pytest.raises(ValueError, match="rank 4.*rank 8"):
            engine.update_weights(WeightUpdate(version=2, state_dict=adapter,
                                               lora={**trainer.adapter, "r": 8}))
        missing = dict(list(adapter.items())[1:])
        with pytest.raises(ValueError, match="does not fit the model's LoRA layers: missing"):
            engine.update_weights(WeightUpdate(version=2, state_dict=missing,
                                               lora=trainer.adapter))
        with pytest.raises(ValueError, match="takes adapters"):
            engine.update_weights(WeightUpdate(version=2, path=str(tiny_model_dir)))
    finally:
        engine.close()


def test_a_lora_checkpoint_holds_the_adapter_only_and_resumes_it(world, trained, tiny_model_dir,
                                                                  tmp_path):
    trainer, _, _ = trained
    import torch.distributed.checkpoint as dcp

    checkpoint.save_checkpoint(trainer, tmp_path / "ckpt", extra_state={"x": 1})
    stored = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata()
    model_keys = {k.removeprefix("model.") for k in stored.state_dict_metadata
                  if k.startswith("model.")}
    # the adapter's tensors and nothing of the base (not even the tied LM head)
    assert model_keys == {n for n, _ in trainer.model.named_parameters() if is_adapter(n)}
    fresh = lora_trainer(tiny_model_dir)
    assert checkpoint.load_checkpoint(fresh, tmp_path / "ckpt") == {"x": 1}
    for (name, a), b in zip(trainer.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.steps == trainer.steps == 2
    batch = fixed_batch(trainer.model.config.vocab_size)  # and the optimizer state came back
    one, two = trainer.train(batch.clone(), TokenNLL()), fresh.train(batch.clone(), TokenNLL())
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for a, b in zip(trainer.model.parameters(), fresh.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# -- the protocol server's LoRA endpoints, as SGLang's ----------------------------------------


def serve_in_thread(model_dir, enable_lora: bool):
    import uvicorn

    from areal_flow.protocol_server.app import build_app

    engine = LocalEngine(model_dir, version=7)
    app = build_app(engine, enable_lora=enable_lora)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # uvicorn's own flag, set once it listens
        thread.join(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", server, thread, engine


def test_protocol_server_loads_and_unloads_adapters_as_sglang_does(trained, tiny_model_dir):
    _, _, export = trained
    adapted, _ = greedy_reference(export)
    base, _ = greedy_reference(tiny_model_dir)
    assert adapted != base  # so that the checks below can tell them apart
    url, server, thread, engine = serve_in_thread(tiny_model_dir, enable_lora=True)
    gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                    "temperature": 0, "ignore_eos": True}}
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            load = {"lora_name": "policy", "lora_path": str(export / "adapter")}
            reply = http.post("/load_lora_adapter", json=load)
            assert reply.status_code == 200, reply.text
            assert reply.json() == {"success": True, "error_message": None,
                                    "loaded_adapters": {"policy": str(export / "adapter")}}
            again = http.post("/load_lora_adapter", json=load)
            assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
            assert http.post("/generate", json={**gen, "lora_path": "policy"}).json()[
                "output_ids"] == adapted
            unknown = http.post("/generate", json={**gen, "lora_path": "other"})
            assert unknown.status_code == 400 and "not loaded" in unknown.text
            assert http.post("/generate", json=gen).status_code == 400  # must name it here
            # the version stays (SGLang's load does not change it)
            assert http.get("/model_info").json()["weight_version"] == "7"
            gone = http.post("/unload_lora_adapter", json={"lora_name": "policy"})
            assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {}
            assert http.post("/generate", json=gen).json()["output_ids"] == base
            missing = http.post("/unload_lora_adapter", json={"lora_name": "policy"})
            assert missing.status_code == 400 and "does not exist" in missing.text
            bad = http.post("/load_lora_adapter", json={"lora_name": "x",
                                                        "lora_path": str(tiny_model_dir)})
            assert bad.status_code == 400 and "not a PEFT adapter folder" in bad.text
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()


@pytest.mark.faults
def test_a_server_without_enable_lora_refuses_adapters_with_sglangs_message(trained,
                                                                             tiny_model_dir):
    _, _, export = trained
    url, server, thread, engine = serve_in_thread(tiny_model_dir, enable_lora=False)
    try:
        reply = httpx.post(f"{url}/load_lora_adapter", timeout=30, json={
            "lora_name": "policy", "lora_path": str(export / "adapter")})
        assert reply.status_code == 400
        assert reply.json()["error_message"] == ("LoRA is not enabled. Please set "
                                                 "`--enable-lora` to enable LoRA.")
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()


def test_the_adapter_folder_round_trips(trained, tmp_path):
    from areal_flow.lora import save_adapter

    trainer, _, _ = trained
    state = trainer.full_state_dict()
    save_adapter(tmp_path, state, trainer.adapter)
    config, loaded = load_adapter(tmp_path)
    assert config == trainer.adapter
    assert set(loaded) == {k for k in state if is_adapter(k)}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state[name])
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["target_modules"] == sorted(
        saved["target_modules"])


# -- the recipe ---------------------------------------------------------------------------------


def lora_args(model, data, run_dir, *extra):
    return ["--model", str(model), "--dataset", str(data), "--run-dir", str(run_dir),
            "--steps", "3", "--eval-size", "4", "--save-every", "3",
            "--rollout.batch-size", "2", "--rollout.group-size", "2",
            "--sampling.max-new-tokens", "8", "--train.optim.lr", "1e-2",
            "--inference.dtype", "float32", "--train.lora.rank", "4",
            "--reward", "tests.rewards_for_tests:completion_length",  # rewards differ: updates
            *extra]


@pytest.mark.parametrize("backend", ["local", "sglang"])
def test_the_recipe_trains_lora_and_syncs_only_the_adapter(tiny_model_dir, gsm8k_file, tmp_path,
                                                           backend):
    # fp32 training without FSDP shares its tensors with the in-process engine; the KL term
    # makes the base model the reference role (the policy with its adapter off)
    extra = ["--inference.backend", "sglang", "--inference.server-program", "areal-flow",
             "--inference.server-gpus", "0"] if backend == "sglang" else [
        "--train.dtype", "float32", "--algorithm.kl-coef", "0.05"]
    run_recipe("gsm8k_grpo.py", lora_args(tiny_model_dir, gsm8k_file, tmp_path / "run", *extra),
               timeout=400)
    steps = [m for m in metrics(tmp_path / "run") if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    adapter = load_adapter(tmp_path / "run" / "checkpoints" / "step-000003" / "hf" / "adapter")[1]
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    model_bytes = 4 * sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(
        tiny_model_dir).parameters())
    sent = {m["sync/bytes"] for m in steps}
    # the in-process engine keeps the trainer's tensors (nothing copied); servers get the
    # adapter folder, never the model
    assert sent == ({0.0} if backend == "local" else {float(adapter_bytes)})
    assert adapter_bytes < model_bytes / 5
    if backend == "sglang":
        served = [m["pool/requests"] for m in steps if "pool/requests" in m]
        assert sum(served) > 0
    else:  # the reference is the base model: the policy starts there and moves away from it
        assert steps[0]["kl_ref"] == 0 and steps[-1]["kl_ref"] > 0
    assert all(m["grad_norm"] > 0 for m in steps)


def test_the_sglang_pool_swaps_adapters_and_catches_a_joining_server_up(trained, tiny_model_dir,
                                                                        tmp_path):
    """Each update replaces every server's adapter (unload, load, version); a server that joins
    later loads the latest adapter before its first request."""
    from areal_flow.inference.launcher import SGLangLauncher, lora_args, serve_command
    from areal_flow.inference.sglang_pool import LORA_NAME, SGLangPool
    from tests.test_sglang_pool import generate_all, greedy, write_addresses

    _, _, export = trained
    adapted, _ = greedy_reference(export)
    listing = tmp_path / "servers.txt"
    with SGLangLauncher(tiny_model_dir, gpus=[0, 1], log_dir=str(tmp_path / "servers"),
                        command=functools.partial(serve_command, dtype="float32"),
                        extra_args=lora_args("areal-flow", LoraConfig(rank=4))) as servers:
        a, b = servers.addresses
        write_addresses(listing, a)
        pool = SGLangPool(addresses_file=listing, refresh_interval=3600)  # refresh() re-reads
        try:
            for version in (1, 2):  # the second replaces the first on the same name
                pool.update_weights(WeightUpdate(version=version, path=str(export / "adapter"),
                                                 lora=trained[0].adapter))
            write_addresses(listing, a, b)
            pool.refresh()
            for address in (a, b):
                info = httpx.get(f"http://{address}/model_info", timeout=30).json()
                assert info["weight_version"] == "2"
                direct = httpx.post(f"http://{address}/generate", timeout=60, json={
                    "input_ids": PROMPT, "lora_path": LORA_NAME, "sampling_params": {
                        "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
                assert direct.json()["output_ids"] == adapted
            outs = generate_all(pool, [greedy(PROMPT, NEW_TOKENS) for _ in range(4)])
            assert all(list(o.token_ids) == adapted and set(o.versions) == {2} for o in outs)
            assert {s["address"]: s["routed"] > 0 for s in pool.servers()} == {a: True, b: True}
        finally:
            pool.close()
