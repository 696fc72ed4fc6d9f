"""`verifiers`: one rollout of a `verifiers` (>= 0.4, `verifiers.v1`) environment per episode
(`pip install 'areal-flow[verifiers]'`).

The environment, a taskset package named by its `vf-eval` id, is played by its harness: each
episode runs `Env.run_episode` on one task with `ctx.openai_server()` as the model endpoint, so
the pool generates every call the harness makes and records it token-in/token-out. The episode is
`ctx.recorded_episode()`; its reward is the trace's (the weighted sum of the task's `@vf.reward`
functions), its metrics each reward's score and each `@vf.metric` value.

A dataset row is `{"idx": n}`, the taskset's n-th task in `load()` order, or else the task's own
data: the fields of its `TaskData` class (`prompt`, `answer`, ...).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import attrs

from areal_flow.workflow import workflow
from areal_flow.workflow.context import RolloutContext


def _named(instance: Any, attribute: Any, value: str) -> None:
    if not value:
        raise ValueError("workflow 'verifiers' needs 'environment', a verifiers taskset id (an "
                         "installed package): --workflow-config '{\"environment\": \"my-env\"}'")


@attrs.frozen(kw_only=True)
class VerifiersConfig:
    """Options of the verifiers workflow."""

    environment: str = attrs.field(default="", validator=_named)
    """The verifiers taskset id: an installed package (`owner/name@version` imports `name`)."""
    env_kwargs: dict[str, Any] = attrs.field(factory=dict)
    """The taskset's config fields (vf-eval's `--env.taskset.*`), e.g. {"num_tasks": 100}."""
    env_config: dict[str, Any] = attrs.field(factory=dict)
    """The env config's other fields (`--env.*`), e.g. {"agent": {"harness": {"id": "null"}}}.
    A single-agent env's agent runs in the local `subprocess` runtime unless this names one."""
    sampling: dict[str, Any] = attrs.field(factory=dict)
    """Sampling imposed on every model call (temperature, top_p, max_tokens); what is unset
    comes from the harness's request, then from the run's --sampling."""

    def __attrs_post_init__(self) -> None:
        _env_config(self.key())  # an unknown taskset or a bad field fails now, by name

    def key(self) -> str:
        """What names the verifiers env config (all but `sampling`), as JSON."""
        sampling = attrs.fields(VerifiersConfig).sampling
        return json.dumps(attrs.asdict(self, filter=attrs.filters.exclude(sampling)),
                          sort_keys=True)


@functools.cache
def _env_config(key: str) -> Any:
    """The validated verifiers env config for `key` (the workflow config as JSON)."""
    import verifiers.v1 as vf

    cfg = json.loads(key)
    data = {**cfg["env_config"], "taskset": {**cfg["env_config"].get("taskset", {}),
                                            **cfg["env_kwargs"], "id": cfg["environment"]}}
    if "agent" in vf.env_config_type(cfg["environment"], data.get("id") or "").model_fields:
        data.setdefault("agent", {}).setdefault("runtime", {"type": "subprocess"})
    return vf.resolve_env_config(data)


@functools.cache
def _tasks(key: str) -> list[Any]:
    """The taskset's tasks, loaded once per process."""
    import verifiers.v1 as vf

    taskset = vf.load_environment(_env_config(key)).taskset
    if not taskset.bounded:
        raise ValueError(f"taskset {taskset.config.id!r} is infinite: {{'idx': n}} rows cannot "
                         "name its tasks; give rows with the task's own data")
    return list(taskset)


def _task(env: Any, key: str, row: dict[str, Any]) -> Any:
    if isinstance(row, dict) and set(row) == {"idx"}:
        tasks = _tasks(key)
        if not 0 <= row["idx"] < len(tasks):
            raise IndexError(f"row {row}: the taskset has {len(tasks)} tasks")
        return tasks[row["idx"]]
    taskset = env.taskset
    task_type = taskset.task_type()
    task = task_type(task_type.data_type().model_validate(row), taskset.config.task)
    return task.with_system_prompt(taskset.system_prompt) if taskset.system_prompt else task


@workflow("verifiers", config=VerifiersConfig)
async def verifiers(ctx: RolloutContext, sample: dict):
    import verifiers.v1 as vf

    cfg = ctx.config or VerifiersConfig()
    key = cfg.key()
    env = vf.load_environment(_env_config(key))  # one an episode: serving() state is on it
    task = _task(env, key, sample)
    access = await ctx.openai_server()
    var = "AREAL_FLOW_API_KEY_" + access.api_key.replace("-", "_").upper()  # verifiers reads
    os.environ[var] = access.api_key  # a key from the environment; each episode has its own
    model = vf.ModelContext(model="policy", sampling=vf.SamplingConfig(**cfg.sampling),
                            client=vf.EvalClientConfig(base_url=access.base_url, api_key_var=var))
    try:
        async with env.serving():
            result = await env.run_episode(task, model)
    finally:
        os.environ.pop(var, None)
    errors = [*result.errors, *(e for trace in result.traces for e in trace.errors)]
    if errors or not result.ok:
        why = f"{errors[-1].type}: {errors[-1].message}" if errors else "a trace did not finish"
        raise RuntimeError(f"verifiers environment {cfg.environment!r} failed: {why}")
    if len(result.traces) != 1:
        raise ValueError(f"verifiers environment {cfg.environment!r} ran {len(result.traces)} "
                         "agents in one episode; this workflow trains single-agent envs")
    trace = result.traces[0]
    episode = ctx.recorded_episode()
    episode.reward = trace.reward
    scores = {name: r.score for name, r in trace.rewards.items() if r is not None}
    episode.metrics.update({name.replace("/", "_"): float(value) for name, value in
                            {**scores, **trace.metrics}.items() if value is not None})
    episode.info["verifiers"] = {"environment": cfg.environment, "task": trace.task.key,
                                 "stop": trace.stop_condition, "turns": trace.num_turns}
    return episode
