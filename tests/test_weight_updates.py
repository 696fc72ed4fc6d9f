"""Weight updates that a busy, slow or concurrently written server must not get wrong (issue 36):
SGLang's refused cache flush, leases held through a slow catch-up, and weight folders a joining
server may read while the trainer writes the next version. In-process `areal-flow serve` apps
(one engine each), so a test can hook the engine."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from areal_flow.launch.lease import Leases, ServerLeased
from areal_flow.inference.local import LocalEngine
from areal_flow.protocol_server.app import build_app
from areal_flow.inference.sglang_pool import SGLangPool
from areal_flow.types import WeightUpdate
from tests.test_local_engine import prompts, save_perturbed
from tests.test_protocol_server import wait_for
from tests.test_sglang_pool import generate_all, greedy, write_addresses


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, max_batch_size=4, version=0)
    app = build_app(engine)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_for(lambda: uv.started, what="uvicorn to start")
    address = f"127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    with httpx.Client(base_url=f"http://{address}", timeout=60) as http:
        yield SimpleNamespace(address=address, engine=engine, state=app.state.server, http=http)
    uv.should_exit = True
    thread.join(30)
    engine.close()


@pytest.fixture(scope="module")
def w2_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return save_perturbed(tiny_model_dir, tmp_path_factory.mktemp("w2"), 0.05, seed=31)


@pytest.fixture
def busy(served):
    """Keeps one long request running on the server (each step slowed a little) until the test
    ends; yields its thread's result holder."""
    served.engine.on_step = lambda engine: time.sleep(0.01)  # keeps it running, orders nothing
    result = {}

    def run() -> None:
        result["reply"] = served.http.post("/generate", json={
            "input_ids": prompts(1)[0], "rid": "busy",
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}})

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: "busy" in served.state.inflight, what="the request to run")
    yield result
    served.http.post("/abort_request", json={"rid": "busy"})
    thread.join(60)
    served.engine.on_step = None


def test_a_joining_server_with_a_request_running_is_paused_before_its_update(served, busy,
                                                                             w2_dir, tmp_path):
    """SGLang answers 400 to an update while a request runs (the cache flush after it is
    refused): a joining server is paused first, so its catch-up succeeds at once."""
    listing = tmp_path / "servers.txt"
    write_addresses(listing)
    pool = SGLangPool(addresses_file=listing, refresh_interval=3600, no_server_timeout=5)
    try:
        pool._version, pool._disk = 4, (str(w2_dir), 4)  # as after an update it missed
        write_addresses(listing, served.address)
        pool.refresh()
        assert pool.servers()[0]["in_rotation"], pool.servers()
        assert served.http.get("/model_info").json()["weight_version"] == "4"
    finally:
        pool.close()


def test_an_update_answered_400_but_applied_counts_as_applied(served, busy, w2_dir,
                                                              tiny_model_dir, monkeypatch):
    """A server whose pause leaves requests running (held, as SGLang's retract does) refuses the
    flush after the update, 400, with the weights loaded: the pool reads its version."""
    monkeypatch.setitem(served.state.pause_modes, "abort", served.state._hold)
    pool = SGLangPool([served.address], refresh_interval=3600)
    try:
        pool.update_weights(WeightUpdate(version=5, path=str(w2_dir)))
        assert pool.version == 5
        assert served.http.get("/model_info").json()["weight_version"] == "5"
        monkeypatch.undo()
        out = generate_all(pool, [greedy(prompts(1)[0], 2)])[0]
        assert set(out.versions) == {5}
    finally:
        pool.close()


@pytest.mark.faults
def test_leases_are_renewed_while_a_joining_server_catches_up(served, w2_dir, tmp_path,
                                                              monkeypatch):
    leases = Leases(tmp_path / "leases", holder="run A", ttl=1.5)
    listing = tmp_path / "servers.txt"
    write_addresses(listing)
    pool = SGLangPool(addresses_file=listing, refresh_interval=3600, leases=leases)
    entered, release = threading.Event(), threading.Event()
    load = served.engine.update_weights

    def slow_load(update):
        entered.set()
        release.wait(60)
        return load(update)

    try:
        pool._version, pool._disk = 6, (str(w2_dir), 6)  # as after an update it missed
        monkeypatch.setattr(served.engine, "update_weights", slow_load)
        write_addresses(listing, served.address)
        catching_up = threading.Thread(target=pool.refresh)
        catching_up.start()
        assert entered.wait(60)
        time.sleep(2 * leases.ttl)  # the lease would have expired without renewal
        with pytest.raises(ServerLeased, match="leased by run A"):
            Leases(tmp_path / "leases", holder="run B").acquire(served.address)
        release.set()
        catching_up.join(60)
        assert pool.servers()[0]["in_rotation"]
    finally:
        release.set()
        pool.close()


def folder_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(path.rglob("*")):
        if file.is_file():
            digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


def test_sync_weights_never_writes_into_the_folder_the_pool_names(tiny_model_dir, tmp_path):
    """A server joining while the trainer writes version n+1 loads the folder the pool named for
    version n (`_disk`): that folder must hold version n, whole, until the pool names another."""
    import torch

    from areal_flow.runtime.engine import TrainConfig, TrainEngine

    named: list[tuple[str, int, str | None]] = []

    class Pool:
        def update_weights(self, update):
            # what a server joining now would load under the version named before
            before = named[-1] if named else None
            if before is not None:
                assert folder_digest(Path(before[0])) == before[2], "rewritten in place"
            named.append((update.path, update.version, folder_digest(Path(update.path))))

    trainer = TrainEngine(tiny_model_dir, TrainConfig())
    try:
        folder = tmp_path / "weights"
        trainer.sync_weights(Pool(), 1, folder=folder)
        with torch.no_grad():
            next(trainer.model.parameters()).add_(0.5)
        trainer.sync_weights(pool := Pool(), 2, folder=folder)
        assert [v for _, v, _ in named] == [1, 2] and named[0][0] != named[1][0]
        assert Path(named[1][0]).parent == folder
        del pool
    finally:
        if torch.distributed.is_initialized():  # the runtime's own one-process world
            torch.distributed.destroy_process_group()
