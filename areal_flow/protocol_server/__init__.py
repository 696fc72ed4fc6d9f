"""The SGLang-protocol server, an optional part: SGLang's HTTP protocol (the part areal_flow
uses) in front of the in-process `LocalEngine`, for CPU machines and tests (`areal-flow serve`).

The request bodies SGLang accepts (`requests`), the handlers and the app (`app`), and the
weight-update process group a trainer broadcasts into (`weight_group`).

An SGLang server cannot start on a CPU-only machine, so tests and CPU runs start this one instead
(`areal-flow serve`), and the SGLang generation pool talks to it exactly as to SGLang. Field names,
defaults, status codes and response shapes follow SGLang's ``entrypoints/http_server.py``,
``managers/io_struct.py``, ``sampling/sampling_params.py`` and ``utils/weight_versions.py``
(SGLANG_PROTOCOL.md has the summary). Where this server differs:

- One sequence per ``/generate``; no streaming, no ``text`` prompt, no stop strings, penalties,
  grammars, ``n > 1`` or prompt logprobs. Such a field, or an unknown one, is refused with 400
  naming it, so a client never silently gets other semantics. Errors are SGLang's
  ``{"error": {"message": ...}}`` with status 400.
- Weight versions are integers here (sent as strings), except SGLang's ``"default"`` of a server
  started without ``--weight-version``. ``/update_weights_from_disk`` without
  ``weight_version`` bumps the version by one (SGLang keeps it), so tokens from the new weights
  never carry the old version; ``/update_weights_from_distributed`` without it keeps the version,
  as SGLang does, because a bucketed update names the version on its last bucket only. The call
  that changes the version must complete the model's tensors since the last change (the local
  engine refuses a partial update; SGLang would load it silently).
- ``/update_weights_from_distributed`` runs only inside a weight-update session
  (``/begin_weight_update`` ... ``/end_weight_update``), one at a time, as in SGLang 0.5.23.
- ``/health`` and ``/health_generate`` are SGLang's generation check: after `health_delay`
  (SGLang: 1 s; here 0 by default) one greedy token through the engine, 200; a check that takes
  longer than `health_timeout` (SGLang: 20 s) after that, e.g. held by a pause, answers 503.
- ``meta_info.weight_versions`` is always sent (SGLang's current behaviour): half-open
  ``[start, end)`` spans over the output tokens, one per run of tokens from one version;
  ``weight_version`` is the last span's.
- ``in_place`` pauses like ``retract``: held requests are re-prefilled under the weights loaded
  at ``/continue_generation`` (the engine keeps no KV cache across a pause). There is no prefix
  cache (``cached_tokens`` is 0), but a flush is refused as SGLang refuses it: ``/flush_cache``,
  and the flush after a weight update (``flush_cache``, the default), fail with 400 while a
  request runs or waits, including one just aborted by ``abort_all_requests`` (SGLang aborts
  asynchronously) or held by a retract pause; the update itself is then already applied.
- An empty body is a 400 on every POST route, and ``sampling_seed`` must lie in
  ``[-2**63, 2**63)``, as in SGLang. A weight-update session belongs to the server: anyone may
  end it (a trainer killed between begin and end leaves it open until someone does).
- The weight-update group is joined as SGLang's ``init_custom_process_group`` joins it: a
  process group of its own (never the default one), rendezvous at ``master_address:master_port``
  with the trainer as rank 0, store keys under the group name. The trainer side
  (`areal_flow.runtime.weight_sync`) builds the same group from public torch classes. A server is
  in one group at a time (``/destroy_weights_update_group`` leaves it).
- LoRA (``--enable-lora``): ``/load_lora_adapter`` (a PEFT folder) and ``/unload_lora_adapter``
  as in SGLang, and ``lora_path`` on ``/generate`` names the adapter. One adapter at a time (a
  second load is refused until the first is unloaded), and while one is loaded every request
  must name it (SGLang would serve a request without ``lora_path`` from the base model in the
  same batch; the local engine cannot mix them). Later adapters must have the first one's rank,
  alpha and target modules. Loading keeps the weight version, as in SGLang.
- ``GET /get_load`` is this server's own: the requests in flight with the tokens each has generated
  so far, and the requests held by a pause (tests wait on it instead of sleeping).
"""
