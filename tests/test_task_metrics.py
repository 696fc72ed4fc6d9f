"""A task's own numbers reach the panel, metrics.jsonl, eval and samples.jsonl (a reward's
`metrics`, `Episode.metrics`); `--algorithm NAME` picks any registered algorithm with typed
options; run folders are named after the task."""

from __future__ import annotations

import asyncio
import math

import attrs
import pytest
import torch

from areal_flow import registry, rl_recipes, reward, workflow
from areal_flow.algorithms.grpo import GRPOConfig
from areal_flow.algorithms.ppo import PPOConfig
from areal_flow.config import RolloutConfig
from areal_flow.rl_recipes import RLConfig
from areal_flow.rollout.scheduler import RolloutError, RolloutScheduler
from areal_flow.live_display import LiveDisplay
from areal_flow.types import SamplingParams
from areal_flow.workflow.context import RolloutContext
from tests.test_scheduler import InstantPool, NullTokenizer


def checks(completion: str, *, answer: str) -> dict[str, float]:
    return {"exact": float(completion == answer), "long": float(len(completion) > 3)}


@reward("tests.task_metrics.exact", metrics=checks, rates=("exact",))  # `long`: a value
def exact(completion: str, *, answer: str) -> float:
    return float(completion == answer)


async def score_of_the_runner(reward, completion, **kwargs):  # the runner's part, in-process
    return registry.rewards.get(reward)(completion, **kwargs)


class Tokenizer(NullTokenizer):
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def context() -> RolloutContext:
    return RolloutContext(pool=InstantPool(), tokenizer=Tokenizer(), score=score_of_the_runner,
                          sampling=SamplingParams(), episode_id="0/0/0")


def test_a_rewards_metrics_are_recorded_for_its_episode_with_the_rewards_arguments():
    ctx = context()
    assert asyncio.run(ctx.reward("tests.task_metrics.exact", "four", answer="four")) == 1.0
    assert ctx.metrics == {"exact": 1.0, "long": 1.0}
    asyncio.run(ctx.reward("tests.task_metrics.exact", "no", answer="four"))
    assert ctx.metrics == {"exact": 0.0, "long": 0.0}  # the latest call's, per name


def test_gsm8k_reports_its_grades_and_a_reward_without_metrics_reports_none():
    ctx = context()
    asyncio.run(ctx.reward("gsm8k", "2 + 3 = 5 so #### 5", answer="#### 5"))
    assert ctx.metrics == {"accuracy": 1.0, "accuracy_lenient": 1.0, "format": 1.0,
                           "work_shown": 1.0}
    plain = context()
    asyncio.run(plain.reward("tests.rewards_for_tests:completion_length", "abc"))
    assert plain.metrics == {}


@workflow("tests.task_metrics.flow")
async def flow(ctx, sample):
    """Scores with the reward's metrics; each row adds a rate of its own (`first`), row 1 a
    count (`turns`) and overrides one."""
    prompt = ctx.chat([{"role": "user", "content": sample["text"]}])
    episode = ctx.episode(prompt, await ctx.generate(prompt))
    episode.reward = await ctx.reward("tests.task_metrics.exact", sample["text"],
                                      answer=sample["answer"])
    episode.info["text"] = sample["text"]
    episode.metrics["first"] = float(sample["id"] == 0)
    episode.rates.add("first")
    if sample["id"] == 1:
        episode.metrics.update(turns=1, long=1.0)
    return episode


@workflow("tests.task_metrics.bad")
async def bad(ctx, sample):
    prompt = ctx.chat([{"role": "user", "content": "x"}])
    episode = ctx.episode(prompt, await ctx.generate(prompt), reward=0.0)
    episode.metrics[sample["name"]] = sample["value"]
    episode.rates.update(sample.get("rates", ()))
    return episode


def run(workflow_name: str, rows: list[dict], **config):
    with RolloutScheduler(
            pool=InstantPool(), workflow=workflow_name, dataset=rows, tokenizer=Tokenizer(),
            score=score_of_the_runner, sampling=SamplingParams(), shuffle=False,
            config=RolloutConfig(**{"batch_size": len(rows), "group_size": 1, "max_concurrent": 4,
                                    "max_staleness": 0, **config})) as scheduler:
        batch = scheduler.prepare_batch(timeout=30)
        evaluated = rl_recipes.evaluate(RLConfig(eval_size=len(rows)), scheduler, rows)
        shown = rl_recipes.samples(RLConfig(samples_per_step=len(rows)), batch, scheduler)
        return rl_recipes.batch_metrics(RLConfig(), batch, scheduler), evaluated, shown


ROWS = [{"id": 0, "text": "four", "answer": "four"}, {"id": 1, "text": "one", "answer": "two"},
        {"id": 2, "text": "three", "answer": "two"}]


def test_batch_eval_and_samples_carry_the_tasks_own_numbers():
    metrics, evaluated, shown = run("tests.task_metrics.flow", ROWS)
    # per row: exact 1, 0, 0; long 1, 1 (the workflow's own wins over 0), 1; first 1, 0, 0;
    # turns only on row 1
    assert metrics["exact"] == pytest.approx(1 / 3)
    assert metrics["long"] == 1.0
    assert metrics["turns"] == 1.0  # averaged over the rows that report it
    assert metrics["task_metrics"] == ["exact", "first", "long", "turns"]
    assert evaluated["eval/exact"] == evaluated["eval/first"] == pytest.approx(1 / 3)
    assert evaluated["eval/reward"] == pytest.approx(1 / 3)
    # rates get their 95% interval: the reward's (exact) and the workflow's (first)
    for rate in ("exact", "first"):
        assert evaluated[f"eval/{rate}_ci_low"] < 1 / 3 < evaluated[f"eval/{rate}_ci_high"]
    # values get none, though every value they took was 0 or 1: a count, a declared value
    assert evaluated["eval/turns"] == pytest.approx(1 / 3) and evaluated["eval/long"] == 1.0
    assert {"eval/long_ci_low", "eval/turns_ci_low", "eval/long_ci_high",
            "eval/turns_ci_high"}.isdisjoint(evaluated)
    assert [s["metrics"] for s in shown] == [{"exact": 1.0, "long": 1.0, "first": 1.0},
                                             {"exact": 0.0, "long": 1.0, "turns": 1,
                                              "first": 0.0},
                                             {"exact": 0.0, "long": 1.0, "first": 0.0}]
    assert [s["info"]["text"] for s in shown] == ["four", "one", "three"]


@pytest.mark.parametrize(("name", "value", "message"), [
    ("accuracy", "high", r"episode.metrics\['accuracy'\] is str 'high'; a metric is a number"),
    ("eval/accuracy", 1.0, r"metric name 'eval/accuracy' must be a plain word"),
    ("turns", 3, r"episode.metrics\['turns'\] is 3, but it is declared a rate .* a rate is 0 or 1"),
    ("solved", 1.0, r"episode.rates names \['sovled'\], which episode.metrics does not hold"),
])
def test_a_metric_that_is_not_a_named_number_fails_once_naming_it(name, value, message):
    rates = {"turns": ["turns"], "solved": ["sovled"]}.get(name, [])
    with pytest.raises(RolloutError, match=message):
        run("tests.task_metrics.bad", [{"name": name, "value": value, "rates": rates}],
            max_retries=2)


def test_a_reward_declares_rates_only_with_a_metrics_function():
    with pytest.raises(ValueError, match=r"'rates' \['accuracy'\] name metrics, but reward "
                                         r"'tests.no_metrics' declares no 'metrics' function"):
        reward("tests.no_metrics", rates=("accuracy",))(lambda completion: 0.0)


def test_the_panel_shows_the_tasks_metrics_where_the_columns_say(capsys):
    display = LiveDisplay(2, 0, columns={"reward/mean": "reward", "task_metrics": "",
                                         "eval/task_metrics": "eval ", "seconds/step": "s/step"})
    display.update(1, {"reward/mean": 0.5, "solved": 0.25, "eval/solved": 0.75,
                       "task_metrics": ["solved"], "seconds/step": 2.0})
    display.update(2, {"reward/mean": 0.5, "solved": 0.125, "seconds/step": 2.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 1/2 reward 0.5 solved 0.25 eval solved 0.75 s/step 2 ")
    assert lines[1].startswith("step 2/2 reward 0.5 solved 0.125 s/step 2 ")  # names are kept


def test_runs_are_named_after_the_task_and_the_algorithm():
    assert rl_recipes.run_name(RLConfig()) == "gsm8k_grpo"
    assert rl_recipes.run_name(RLConfig(dataset="data/countdown.jsonl")) == "countdown_grpo"
    assert rl_recipes.run_name(RLConfig(dataset="reasoning_gym:chain_sum?size=9")) == \
        "chain_sum_grpo"
    assert rl_recipes.run_name(attrs.evolve(RLConfig(), workflow="countdown.two_turn",
                                          algorithm_name="ppo", algorithm=PPOConfig())) == \
        "countdown.two_turn_ppo"


def test_algorithm_picks_the_registered_config_class_and_its_typed_options():
    cfg = rl_recipes.cli(RLConfig, ["--algorithm", "ppo", "--algorithm.lam", "0.5", "--steps", "3"])
    assert (cfg.algorithm_name, cfg.algorithm, cfg.steps) == ("ppo", PPOConfig(lam=0.5), 3)
    assert type(rl_recipes.algorithm(cfg)) is registry.algorithms.get("ppo")
    # without --algorithm: the recipe's own, with its own typed options as before
    cfg = rl_recipes.cli(RLConfig, ["--algorithm.kl-coef", "0.1"])
    assert (cfg.algorithm_name, cfg.algorithm) == ("grpo", GRPOConfig(kl_coef=0.1))
    by_path = rl_recipes.cli(RLConfig, ["--algorithm=areal_flow.algorithms.ppo:PPO"])
    assert by_path.algorithm == PPOConfig()


def test_algorithm_help_lists_that_algorithms_options(capsys):
    with pytest.raises(SystemExit):
        rl_recipes.cli(RLConfig, ["--algorithm", "ppo", "--help"])
    shown = capsys.readouterr().out
    assert "--algorithm.lam" in shown and "--algorithm.std-normalize" not in shown


def test_workflow_help_lists_that_workflows_options_after_the_recipes(capsys):
    with pytest.raises(SystemExit):
        rl_recipes.cli(RLConfig, ["--workflow=tool_use", "--help"])
    shown = capsys.readouterr().out
    recipe, workflow = shown.index("--rollout.batch-size"), shown.index("--max-calls INT")
    assert recipe < workflow and "Most calculator calls per episode." in shown
    assert "--max-turns" not in shown  # multi_turn's, not tool_use's
    with pytest.raises(SystemExit):
        rl_recipes.cli(RLConfig, ["--workflow", "no_such_flow", "-h"])
    assert "--workflow no_such_flow: unknown workflow 'no_such_flow'" in capsys.readouterr().err


def test_options_of_another_algorithm_are_refused():
    with pytest.raises(ValueError, match="--algorithm ppo takes a PPOConfig as its options, "
                                         "not a GRPOConfig"):
        RLConfig(algorithm_name="ppo")
    with pytest.raises(SystemExit):  # GRPO's option after --algorithm ppo: tyro names it
        rl_recipes.cli(RLConfig, ["--algorithm", "ppo", "--algorithm.kl-coef", "0.1",
                                "--algorithm.std-normalize"])


def test_an_algorithm_that_needs_groups_refuses_groups_of_one_before_any_work():
    with pytest.raises(ValueError, match="--rollout.group-size 1: grpo scores a row against"):
        rl_recipes.algorithm(RLConfig(rollout=RolloutConfig(group_size=1, batch_size=2)))
    assert rl_recipes.algorithm(RLConfig(rollout=RolloutConfig(group_size=2, batch_size=2)))


def test_collate_marks_a_metric_an_episode_did_not_report_as_nan():
    from areal_flow.data.collate import collate_groups
    from areal_flow.types import Episode

    reported = Episode.start([1], reward=0.0)
    reported.metrics["solved"] = 1
    batch = collate_groups([[reported, Episode.start([1], reward=0.0)]])
    solved = batch["metrics", "solved"]
    assert solved[0].item() == 1.0 and math.isnan(solved[1].item())
    assert solved.dtype == torch.float32


def test_the_entropy_watch_warns_once_when_entropy_falls_below_a_fifth_of_its_first():
    watch = rl_recipes.EntropyWatch()
    readings = [None, math.nan, 2.0, 1.0, 0.41, 0.39, 0.1, 0.05]  # untrained steps first
    said = [watch.check({} if e is None else {"entropy": e}) for e in readings]
    assert [i for i, s in enumerate(said) if s] == [5]  # 0.39 < 0.2 x 2.0; then never again
    assert said[5].startswith("warning: entropy 0.39 nats, below 20% of its first 2:")
    assert "--algorithm.entropy-target" in said[5]  # held entropy on 4 of 5 seeds (step 0.1)
    columns = rl_recipes.panel_columns(RLConfig(), critic=False, teacher=False)
    assert columns["entropy"] == "entropy"
