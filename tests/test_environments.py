"""Text environments and the `env` workflow: the protocol played on scripted replies (sync and
async), the gymnasium adapter on a real text gymnasium.Env, the `environments` registry in
`areal-flow plugins`, an unknown name refused at start, and the gymnasium guess game trained by
the generic GRPO recipe on the tiny model."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_flow import registry, workflows
from areal_flow.agents.environment import GymnasiumEnvironment, environment, gymnasium_env
from areal_flow.types import SamplingParams, derived_seed
from areal_flow.workflow.context import RolloutContext
from areal_flow.agents.env import EnvConfig
from tests.helpers import ScriptedPool, make_distribution, metrics, needs, run_cli, run_recipe

GUESS = "tests.environments_for_tests:GuessNumber-v0"


@environment("tests.script")
class Script:
    """Says "obs N" after the N-th action with the N-th of `rewards`; terminates after
    `terminate_at` actions, truncates after `truncate_at`. Records what it was called with."""

    calls: list = []

    def __init__(self, rewards=(0.0, 0.0, 0.0, 0.0), terminate_at=0, truncate_at=0):
        self.rewards, self.terminate_at, self.truncate_at, self.n = rewards, terminate_at, \
            truncate_at, 0
        Script.calls = []

    def reset(self, *, seed=None, options=None):
        Script.calls.append(("reset", seed, options))
        return f"Start with {options['x']}.", {}

    def step(self, action):
        Script.calls.append(("step", action))
        self.n += 1
        info = {"metrics": {"steps_seen": self.n, "label": "not a number"}, "n": self.n}
        return (f"obs {self.n}", self.rewards[self.n - 1], self.n == self.terminate_at,
                self.n == self.truncate_at, info)

    def close(self):
        Script.calls.append(("close",))


@environment("tests.async_script")
class AsyncScript(Script):
    async def reset(self, *, seed=None, options=None):
        await asyncio.sleep(0)
        return Script.reset(self, seed=seed, options=options)

    async def step(self, action):
        await asyncio.sleep(0)
        return Script.step(self, action)

    async def close(self):
        Script.close(self)


ROW = {"x": 5, "target": 7}


def play(tokenizer, replies, seed=11, row=ROW, **config):
    pool = ScriptedPool(tokenizer, [r if isinstance(r, tuple) else (r, "stop") for r in replies])
    ctx = RolloutContext(pool=pool, tokenizer=tokenizer, score=None,
                         sampling=SamplingParams(max_new_tokens=32), episode_id="0/0/0",
                         config=EnvConfig(**config), seed=seed)
    episode = asyncio.run(workflows.get("env")(ctx, row))
    segments = [(s.trainable, tokenizer.decode(s.token_ids)) for s in episode.segments]
    return episode, segments, pool


def user(text):
    return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["tests.script", "tests.async_script"])
def test_turns_alternate_model_replies_and_untrained_observations(tokenizer, name):
    episode, segments, pool = play(
        tokenizer, ["a", "b", "c"], environment=name, discount=0.5,
        kwargs={"rewards": [1.0, 2.0, 4.0], "terminate_at": 3}, system_prompt="Play.")
    assert segments == [
        (False, "<|im_start|>system\nPlay.<|im_end|>\n<|im_start|>user\nStart with 5.<|im_end|>\n"
                "<|im_start|>assistant\n"),
        (True, "a<|im_end|>"), (False, user("obs 1")),
        (True, "b<|im_end|>"), (False, user("obs 2")),
        (True, "c<|im_end|>")]
    assert episode.reward == 1.0 + 0.5 * 2.0 + 0.25 * 4.0
    # the reset got the row and a seed derived from the episode's; each reply was an action
    assert Script.calls == [("reset", derived_seed(11, "env"), ROW), ("step", "a"),
                            ("step", "b"), ("step", "c"), ("close",)]
    assert episode.metrics == {"turns": 3, "terminated": 1.0, "env_return": 7.0,
                               "steps_seen": 3.0}  # numbers of the final info's "metrics"
    assert episode.info == {"environment": name, "observation": "obs 3",
                            "env_info": {"metrics": {"steps_seen": 3, "label": "not a number"},
                                         "n": 3}}
    assert not episode.truncated
    # each turn continued the previous turn's own tokens; the whole is the rendered chat
    assert pool.prompts[2] == episode.token_ids[: len(pool.prompts[2])]
    chat = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Start with 5."}]
    for reply, obs in (("a", "obs 1"), ("b", "obs 2"), ("c", None)):
        chat += [{"role": "assistant", "content": reply}]
        chat += [{"role": "user", "content": obs}] if obs else []
    assert tokenizer.decode(episode.token_ids) + "\n" == \
        tokenizer.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize(("replies", "config", "turns", "steps"), [
    (["a", "b", "c"], {"max_turns": 2}, 2, 2),  # out of turns
    (["a", "b", "c"], {"kwargs": {"truncate_at": 1}}, 1, 1),  # the environment truncated
    ([("a cut", "length"), "b"], {}, 1, 1),  # cut at the token budget: still the action, then end
])
def test_episodes_that_do_not_terminate_are_truncated(tokenizer, replies, config, turns, steps):
    episode, segments, _ = play(tokenizer, replies, environment="tests.script",
                                **{"kwargs": {"rewards": [0.5] * 4}} | config)
    assert episode.metrics["turns"] == turns and episode.metrics["terminated"] == 0.0
    assert [s for s in Script.calls if s[0] == "step"][-1] == ("step", replies[steps - 1][0]) \
        and len([s for s in Script.calls if s[0] == "step"]) == steps
    assert Script.calls[-1] == ("close",)
    assert [t for t, _ in segments] == [False, True] + [False, True] * (turns - 1)
    assert episode.truncated


@needs("gymnasium", "agents")
def test_the_gymnasium_guess_game_plays_through_the_adapter(tokenizer):
    episode, segments, _ = play(tokenizer, ["5", "I say 9", "7"], environment="gymnasium",
                                kwargs={"id": GUESS, "high": 10, "graded": True})
    assert [text for trained, text in segments if not trained][1:] == \
        [user("Higher."), user("Lower.")]
    assert episode.reward == pytest.approx(0.5 * 0.8 + 0.5 * 0.8 + 1.0)
    assert episode.metrics == {"turns": 3, "terminated": 1.0, "env_return": pytest.approx(1.8),
                               "guesses": 3.0, "solved": 1.0}
    assert episode.info["observation"] == "Correct!" and not episode.truncated
    # gymnasium's own time limit truncates; without a row target the seed draws the number
    episode, *_ = play(tokenizer, ["1", "2", "3"], row={}, environment="gymnasium",
                       kwargs={"id": GUESS, "high": 10**9, "max_episode_steps": 2})
    assert episode.metrics["turns"] == 2 and episode.truncated and episode.reward == 0.0
    assert episode.info["env_info"]["target"] == play(
        tokenizer, ["1"], row={}, environment="gymnasium", max_turns=1,
        kwargs={"id": GUESS, "high": 10**9})[0].info["env_info"]["target"]  # same seed


@needs("gymnasium", "agents")
def test_the_adapter_refuses_environments_whose_spaces_are_not_text():
    with pytest.raises(TypeError, match="observation_space is Box.*gymnasium.spaces.Text"):
        gymnasium_env("CartPole-v1")
    env = GymnasiumEnvironment(gymnasium_env(GUESS).env)
    assert env.reset(seed=0, options={"target": 3})[0].startswith("I picked")
    assert env.step("3")[1:4] == (1.0, True, False)


def test_areal_flow_plugins_lists_environments(tmp_path):
    site = make_distribution(
        tmp_path / "site", "areal-flow-games",
        {"areal_flow.environments": {"games.guess": "games:Guess"}},
        {"games": "class Guess:\n    pass\n"})
    rows = [[c.strip() for c in line.strip("│ ").split("│")]
            for line in run_cli("plugins", paths=(site,)).stdout.splitlines()
            if line.lstrip("│ ").startswith("environment")]
    assert rows == [["environment", "games.guess", "areal-flow-games 0.1", "games:Guess"],
                    ["environment", "gymnasium", "areal-flow 0.1.0",
                     "areal_flow.agents.environment:gymnasium_env"]]
    in_process = {r.name: r for r in registry.environments.plugins()}["tests.script"]
    assert (in_process.kind, in_process.source) == ("environment", "in-process")
    assert registry.environments.get("tests.script") is Script


def test_an_unknown_environment_fails_at_start_with_the_known_names(tiny_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"target": 3}\n')
    result = run_recipe("gsm8k_grpo.py", [
        "--model", str(tiny_model_dir), "--dataset", str(rows), "--run-dir", str(tmp_path / "r"),
        "--workflow", "env", "--workflow-config", '{"environment": "gymnasiun"}'], check=False)
    assert result.returncode != 0
    assert "unknown environment 'gymnasiun'; known: gymnasium" in result.stderr
    assert "Did you mean 'gymnasium'?" in result.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # nothing ran


@needs("gymnasium", "agents")
def test_the_guess_game_trains_through_the_generic_recipe(tiny_model_dir, tmp_path):
    rows = tmp_path / "targets.jsonl"
    rows.write_text("".join(json.dumps({"target": t}) + "\n" for t in (3, 7, 12, 18)))
    config = {"environment": "gymnasium", "max_turns": 3,
              "kwargs": {"id": GUESS, "high": 20, "graded": True}}
    run = tmp_path / "run"
    result = run_recipe("gsm8k_grpo.py", [
        "--model", str(tiny_model_dir), "--dataset", str(rows), "--run-dir", str(run),
        "--steps", "2", "--eval-size", "0", "--rollout.batch-size", "2",
        "--rollout.group-size", "2", "--sampling.max-new-tokens", "8", "--inference.dtype",
        "float32", "--train.dtype", "float32", "--train.optim.lr", "1e-3", "--workflow", "env",
        "--workflow-config", json.dumps(config)])
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(" env_return " in line for line in steps)
    trained = [m for m in metrics(run) if m["step"] > 0]
    assert all(m["train/skipped_rows"] < 4 and m["grad_norm"] > 0 for m in trained), trained
    assert all({"turns", "terminated", "env_return", "guesses", "solved"} <= set(m)
               for m in trained)
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert sample["info"]["environment"] == "gymnasium"
    assert sample["info"]["env_info"]["target"] in (3, 7, 12, 18)
    assert sample["segments"][0]["text"].endswith(
        "I picked a whole number from 1 to 20. Guess it.<|im_end|>\n<|im_start|>assistant\n")
