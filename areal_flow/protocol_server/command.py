"""`areal-flow serve`: the SGLang-protocol server in front of the local engine."""

from __future__ import annotations

from typing import Literal


def command(
    model: str,
    port: int,
    host: str = "127.0.0.1",
    dtype: Literal["auto", "float32", "bfloat16"] = "auto",
    max_batch_size: int = 64,
    seed: int = 0,
    device: str = "auto",
    weight_version: int | None = None,
    health_delay: float = 0.0,
    health_timeout: float = 20.0,
    enable_lora: bool = False,
) -> int:
    """Serve a model with the local engine behind SGLang's HTTP protocol (the part areal_flow
    uses), for CPU machines and tests where SGLang cannot run. Ready when GET /health answers 200.

    Args:
        model: A save_pretrained folder (or hub id when online).
        port: Port to listen on.
        host: Address to listen on.
        dtype: Weights' dtype; auto: the faster for decoding this model here (bf16 on a GPU).
        max_batch_size: Most sequences decoded together; more requests wait in a queue.
        seed: Seeds the sampling of requests that carry no sampling_seed.
        device: auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N.
        weight_version: The version of the weights loaded at start; without it the server
            reports "default", as SGLang does.
        health_delay: Seconds a health check waits before its one-token generation (SGLang: 1).
        health_timeout: Seconds after which a health check (e.g. held by a pause) answers 503.
        enable_lora: Serve LoRA adapters (/load_lora_adapter, /unload_lora_adapter, and
            lora_path on /generate), as SGLang's --enable-lora.
    """
    from areal_flow.protocol_server.app import serve as run_server

    run_server(model, host=host, port=port, dtype=dtype, max_batch_size=max_batch_size, seed=seed,
               device=device, weight_version=weight_version, health_delay=health_delay,
               health_timeout=health_timeout, enable_lora=enable_lora)
    return 0
