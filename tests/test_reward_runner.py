"""Rewards run contained: hung, crashing, raising and out-of-range rewards score their default,
are counted, and the pool recovers for the next call."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_flow.reward.runner import (
    FAILURE_WINDOW,
    RewardFailureError,
    RewardRunner,
    _call_in_worker,
    _exit_status,
    metrics_problem,
    resolve,
    score_with_metrics,
)
from areal_flow.types import RewardSpec
from tests import rewards_for_tests
from tests.helpers import ROOT as REPO


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(max_workers=2) as r:
        yield r


def score(runner, name, text="abc"):
    return asyncio.run(runner.score(name, text))


@pytest.mark.parametrize(
    ("name", "counter", "default"),
    [
        ("tests.sleeps_forever", "timeouts", 0.0),
        ("tests.kills_itself", "crashes", 0.0),
        ("tests.raises", "errors", 0.25),
        ("tests.out_of_range", "invalid", 0.0),
        ("tests.async_hangs", "timeouts", 0.5),
    ],
)
def test_a_misbehaving_reward_scores_its_default_and_the_next_call_is_true(
    runner, name, counter, default
):
    runner.stats()
    assert score(runner, name) == default
    assert score(runner, "tests.length", "hello") == 5.0  # the pool recovered
    stats = runner.stats()
    assert stats[counter] == 1 and stats["calls"] == 2
    others = {"timeouts", "crashes", "errors", "invalid"} - {counter}
    assert all(stats[k] == 0 for k in others)


@pytest.mark.faults
def test_a_worker_killed_while_idle_does_not_break_later_calls():
    """pebble marks its whole pool broken when a worker dies with no task running (an OOM kill,
    an operator's SIGKILL): the runner starts a new pool and the next call scores."""
    with RewardRunner(max_workers=1) as runner:
        scores = []
        for _ in range(2):  # twice: each break is one more restart
            pid = int(score(runner, "tests.worker_pid"))
            assert pid > 1  # -1 is the reward's default: os.kill(-1) would kill every process
            os.kill(pid, signal.SIGKILL)
            scores += [score(runner, "tests.length", "hello") for _ in range(2)]
        stats = runner.stats()
    assert scores == [5.0] * 4
    assert stats["pool_restarts"] == 2 and stats["calls"] == 6 and stats["failure_rate"] == 0


def test_rewards_run_in_light_worker_processes(runner):
    # the parent has torch loaded (the test session imports it); the workers must not (a script
    # importing torch: test_workers_never_import_the_callers_script)
    import torch  # noqa: F401

    assert score(runner, "tests.imports_torch") == 0.0


def test_rewards_are_named_by_registry_name_function_or_path(runner):
    assert asyncio.run(runner.score(rewards_for_tests.length, "four")) == 4.0
    assert asyncio.run(runner.score("tests.rewards_for_tests:length", "xy")) == 2.0
    assert asyncio.run(runner.score("tests.async_ok", "x")) == 1.0
    assert asyncio.run(runner.score("gsm8k", "#### 12", answer="12")) == 1.0


def test_stats_time_each_window_of_calls_from_zero(runner):
    for _ in range(2):
        score(runner, rewards_for_tests.length)
    runner.stats()
    score(runner, rewards_for_tests.length)  # workers warm: milliseconds
    stats = runner.stats()
    assert stats["calls"] == 1 and 0 < stats["mean_seconds"] < 0.5


def test_many_concurrent_calls_all_return(runner):
    async def main():
        return await asyncio.gather(*(runner.score("tests.length", "x" * i) for i in range(40)))

    assert asyncio.run(main()) == [float(i) for i in range(40)]


def test_a_reward_defined_in_a_script_gets_a_clear_error(runner):
    def local(completion):
        return 1.0

    async def local_async(completion):  # async ones run in workers too
        return 1.0

    for fn in (local, local_async):
        with pytest.raises(ValueError, match="cannot be imported by a worker process"):
            asyncio.run(runner.score(fn, "x"))


def test_a_reward_that_cannot_take_the_arguments_fails_instead_of_scoring_its_default(runner):
    runner.stats()
    with pytest.raises(TypeError, match=r"reward 'tests.length' cannot take .*\['answer'\]"):
        asyncio.run(runner.score("tests.length", "abc", answer="12"))
    assert runner.stats()["calls"] == 0  # nothing was sent to a worker


@pytest.mark.faults
def test_a_reward_failing_on_most_calls_stops_instead_of_scoring_defaults():
    """Every call failing: defaults until half a window of calls, then an error that names the
    reward, the rate and the last failure; the failure rate is in stats()."""
    judged = FAILURE_WINDOW // 2
    with RewardRunner(max_workers=1) as r:
        async def calls(n):
            return [await r.score("tests.fails_on_x", "x") for _ in range(n)]

        assert asyncio.run(calls(judged - 1)) == [0.0] * (judged - 1)
        with pytest.raises(RewardFailureError,
                           match=rf"'tests.fails_on_x' failed on {judged} of its last {judged} "
                                 r"calls.*50%.*error: ValueError\('an x'\)"):
            asyncio.run(calls(1))
        assert r.stats()["failure_rate"] == 1.0


@pytest.mark.faults
def test_failures_below_the_limit_score_defaults_and_never_stop():
    texts = ["x" if i % 3 == 0 else "ok" for i in range(2 * FAILURE_WINDOW)]  # a third fail
    with RewardRunner(max_workers=1, max_failure_rate=0.4) as r:
        async def calls():
            return [await r.score("tests.fails_on_x", t) for t in texts]

        assert asyncio.run(calls()) == [0.0 if t == "x" else 1.0 for t in texts]
        assert r.stats()["failure_rate"] == pytest.approx(texts.count("x") / len(texts))
    with pytest.raises(ValueError, match="max_failure_rate"):
        RewardRunner(max_failure_rate=1.5)


def _run_script(folder, body, cwd=None, tests_importable=True):
    """`body` run as a script in `folder` (its own `__main__`, no `if __name__` guard), with
    the repo's tests importable if asked; its stdout's last line, parsed."""
    script = folder / "train.py"
    script.write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if tests_importable:
        env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, env=env, cwd=cwd or folder)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.faults
def test_workers_never_import_the_callers_script(tmp_path):
    """A script without a main guard that imports torch: workers must not run it (it would run
    its body again, and bring torch into every worker)."""
    ran = tmp_path / "ran.txt"
    result = _run_script(tmp_path, f"""
        import asyncio, json
        import torch  # what a recipe imports; a worker importing this script would have it
        from areal_flow.reward.runner import RewardRunner
        from tests.rewards_for_tests import imports_torch, length
        with open({str(ran)!r}, "a") as f:
            f.write("ran\\n")
        runner = RewardRunner(max_workers=1)
        scores = [asyncio.run(runner.score(length, "four")),
                  asyncio.run(runner.score(imports_torch, "x"))]
        print(json.dumps({{"scores": scores, "stats": runner.stats()}}))
        runner.close()
    """)
    assert ran.read_text() == "ran\n"  # the body ran once: in the caller only
    # 0: the worker answered and has no torch (1: it has; -1, the default: the call failed)
    assert result["scores"] == [4.0, 0.0]
    assert result["stats"]["failure_rate"] == 0.0


@pytest.mark.faults
def test_workers_import_the_callers_areal_flow_when_started_beside_a_clone(tmp_path):
    """Started from the folder holding a clone named areal_flow: `areal_flow` there is the
    clone's root (a namespace package whose __init__ never runs), not the package; a worker
    that imports it cannot run a reward written with `from areal_flow import reward`."""
    (tmp_path / "areal_flow").symlink_to(REPO, target_is_directory=True)
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "my_rewards.py").write_text(textwrap.dedent("""
        from areal_flow import reward

        @reward("my.length", range=(0.0, 100.0))
        def length(completion):
            return float(len(completion))
    """))
    result = _run_script(scripts, """
        import asyncio, json
        from areal_flow.reward.runner import RewardRunner
        import my_rewards
        with RewardRunner(max_workers=1) as runner:
            score = asyncio.run(runner.score(my_rewards.length, "four"))
            print(json.dumps({"score": score, "stats": runner.stats()}))
    """, cwd=tmp_path, tests_importable=False)
    assert result["score"] == 4.0
    assert result["stats"]["failure_rate"] == 0.0


@pytest.mark.faults
def test_an_async_reward_blocking_past_its_timeout_is_killed_and_scores_its_default(runner):
    """`time.sleep(20)` in an async reward with a 0.5 s timeout: awaited in the caller's loop it
    would freeze that loop for 20 s; in a worker it is killed at its timeout."""
    runner.stats()
    start = time.monotonic()
    assert score(runner, "tests.async_blocks") == 0.5
    assert time.monotonic() - start < 10
    assert runner.stats()["timeouts"] == 1


@pytest.mark.faults
def test_an_async_reward_that_segfaults_is_a_crash_and_the_caller_survives(tmp_path):
    result = _run_script(tmp_path, """
        import asyncio, json
        from areal_flow.reward.runner import RewardRunner
        import tests.rewards_for_tests
        with RewardRunner(max_workers=1) as runner:
            scores = [asyncio.run(runner.score("tests.async_segfaults", "x")),
                      asyncio.run(runner.score("tests.length", "four"))]
            print(json.dumps({"scores": scores, "stats": runner.stats()}))
    """)
    assert result["scores"] == [0.0, 4.0]
    assert result["stats"]["crashes"] == 1 and result["stats"]["calls"] == 2


def test_the_log_says_how_a_worker_crashed_or_how_long_it_ran(runner, caplog):
    with caplog.at_level(logging.WARNING, logger="areal_flow.reward.runner"):
        score(runner, "tests.kills_itself")
        score(runner, "tests.sleeps_forever")
    assert [r.getMessage() for r in caplog.records] == [
        "reward 'tests.kills_itself': crashed (killed by SIGKILL); scored its default 0.0",
        "reward 'tests.sleeps_forever': timed out after 0.5 s; scored its default 0.0",
    ]


def test_the_worker_popen_is_this_pythons_launch_less_the_main_script():
    """`_WorkerPopen._launch` is a copy of multiprocessing's own plus two `pop`s: a Python
    whose `popen_forkserver.Popen._launch` differs must fail here, not start workers wrongly."""
    import ast
    import inspect
    import textwrap
    from multiprocessing import popen_forkserver

    from areal_flow.reward.runner import _WorkerPopen

    def tree(fn, drop_pops: bool) -> str:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        node.returns = None
        for arg in node.args.args:
            arg.annotation = None
        if drop_pops:
            node.body = [s for s in node.body if not ("prep_data.pop" in ast.unparse(s))]
        return ast.dump(node)

    assert tree(_WorkerPopen._launch, True) == tree(popen_forkserver.Popen._launch, False)


def test_a_failing_metrics_is_a_failure_of_the_reward_that_scored(runner):
    """The reward's score stands; its metrics are left out; the call is counted as failed
    (`metrics_errors`, the failure rate); the next call records them again. What `ctx.reward`
    does with the runner a recipe gives it."""
    from areal_flow.types import SamplingParams
    from areal_flow.workflow.context import RolloutContext

    ctx = RolloutContext(pool=None, tokenizer=None, score=runner.score,
                         sampling=SamplingParams(), episode_id="0/0/0")
    runner.stats()
    assert asyncio.run(ctx.reward("tests.metrics_divide", "")) == 1.0  # 1 / len("")
    assert ctx.metrics == {}
    stats = runner.stats()
    assert (stats["calls"], stats["metrics_errors"], stats["failure_rate"]) == (1, 1, 1.0)
    assert all(stats[k] == 0 for k in ("timeouts", "crashes", "errors", "invalid"))
    assert asyncio.run(ctx.reward("tests.metrics_divide", "four")) == 1.0
    assert ctx.metrics == {"per_character": 0.25}
    assert runner.stats()["failure_rate"] == 0.0


@pytest.mark.parametrize("found", [
    {"per_character": "high"}, {"a/b": 1.0}, {"x": float("inf")}, [("x", 1.0)], None])
def test_metrics_that_are_not_plain_names_of_numbers_are_a_failure_naming_what_is_allowed(
        runner, found, caplog):
    runner.stats()
    with caplog.at_level(logging.WARNING, logger="areal_flow.reward.runner"):
        assert asyncio.run(runner.score_with_metrics("tests.length_with_found", "abc",
                                                     found=found)) == (3.0, {})
    assert runner.stats()["metrics_errors"] == 1
    assert "{name: finite number}" in caplog.text and "no '/'" in caplog.text


@pytest.mark.faults
def test_metrics_that_never_return_are_cut_by_the_rewards_timeout_in_its_worker(runner):
    """The metrics run in the worker, under the reward's timeout: a hung one costs the call
    (the reward's default, counted as a timeout) and never holds the rollout's event loop."""
    async def call():
        return await asyncio.wait_for(runner.score_with_metrics("tests.metrics_hang", "x"), 60)

    runner.stats()
    assert asyncio.run(call()) == (0.25, {})
    assert runner.stats()["timeouts"] == 1


@pytest.mark.faults
def test_metrics_failing_on_most_calls_stop_the_run_as_a_failing_reward_does():
    judged = FAILURE_WINDOW // 2
    with RewardRunner(max_workers=1) as r:
        async def calls(n):
            return [await r.score_with_metrics("tests.metrics_divide", "") for _ in range(n)]

        assert asyncio.run(calls(judged - 1)) == [(1.0, {})] * (judged - 1)
        with pytest.raises(RewardFailureError,
                           match=rf"'tests.metrics_divide' failed on {judged} of its last "
                                 rf"{judged} calls.*metrics error: ZeroDivisionError"):
            asyncio.run(calls(1))


def test_without_a_runner_a_failing_metrics_is_logged_and_records_nothing(caplog):
    """An in-process stand-in for the runner's score (as tests give `RolloutContext`)."""
    from areal_flow.registry import rewards
    from areal_flow.types import SamplingParams
    from areal_flow.workflow.context import RolloutContext

    async def in_process(reward, *args, **kwargs):
        return rewards.get(reward)(*args, **kwargs)

    ctx = RolloutContext(pool=None, tokenizer=None, score=in_process,
                         sampling=SamplingParams(), episode_id="0/0/0")
    with caplog.at_level(logging.WARNING, logger="areal_flow.reward.runner"):
        assert asyncio.run(ctx.reward("tests.metrics_divide", "")) == 1.0
    assert ctx.metrics == {} and "ZeroDivisionError" in caplog.text


def scripted(completion: str) -> float:
    """Stands for a reward defined in the caller's script (its module set to __main__)."""
    return 1.0


class CallableScorer:
    def __call__(self, completion: str) -> float:
        return 1.0


def test_a_reward_from_the_main_script_gets_a_clear_error(runner, monkeypatch):
    monkeypatch.setattr(scripted, "__module__", "__main__")
    with pytest.raises(ValueError, match="cannot be imported by a worker process"):
        asyncio.run(runner.score(scripted, "x"))


def test_an_undecorated_reward_is_named_by_its_qualname_or_else_its_repr():
    assert resolve(scripted) == RewardSpec(name="scripted", fn=scripted)
    scorer = CallableScorer()
    assert resolve(scorer) == RewardSpec(name=repr(scorer), fn=scorer)


def test_a_score_must_be_a_finite_real_number_within_the_range_bounds_included(runner):
    runner.stats()
    assert score(runner, "tests.returns", "0") == 0.0  # the lower bound is in range
    assert score(runner, "tests.returns", "1") == 1.0  # and the upper
    for bad in ("true", "text", "nan", "1.5"):  # a bool, a str, not finite, above the range
        assert score(runner, "tests.returns", bad) == 0.5
    stats = runner.stats()
    assert stats["invalid"] == 4 and stats["calls"] == 6


def test_score_leaves_metrics_alone_and_score_with_metrics_passes_every_argument(runner):
    runner.stats()
    assert score(runner, "tests.metrics_divide", "") == 1.0  # its metrics would fail: not run
    assert asyncio.run(runner.score_with_metrics("tests.length", "abc")) == (3.0, {})
    assert runner.stats()["metrics_errors"] == 0

    async def in_process(reward, *args, **kwargs):
        return resolve(reward).fn(*args, **kwargs)

    for scorer in (runner.score, in_process):
        assert asyncio.run(score_with_metrics(scorer, "tests.matches", "12", answer="12")) == (
            1.0, {"correct": 1.0})
        assert asyncio.run(score_with_metrics(scorer, "tests.matches", "7", answer="12")) == (
            0.0, {"correct": 0.0})
    assert runner.stats()["metrics_errors"] == 0


def test_metrics_problems_name_the_offending_part_and_what_is_allowed():
    allowed = ("a reward's metrics must return {name: finite number}, each name a plain word "
               "(no '/': an eval adds 'eval/')")
    assert metrics_problem([("x", 1.0)]) == f"metrics invalid: returned list [('x', 1.0)]; {allowed}"
    assert metrics_problem({"x": "high"}) == f"metrics invalid: 'x' is str 'high'; {allowed}"
    assert metrics_problem({"": 1.0}) == f"metrics invalid: name ''; {allowed}"
    assert metrics_problem({"ok": 1, "flag": True}) is None


def test_the_worker_entry_runs_sync_and_async_rewards_with_every_argument():
    """What a worker runs, called here: the reward by path, positional and keyword arguments,
    an async one to completion; a worker that imported another areal_flow refuses."""
    import areal_flow

    here = areal_flow.__file__
    value, metrics, rss = _call_in_worker("tests.rewards_for_tests:matches", here, ("12",),
                                          {"answer": "12"})
    assert value == 1.0 and metrics is None and rss > 2**20  # and the worker's resident bytes
    assert _call_in_worker("tests.async_ok", here, ("x",), {})[0] == 1.0
    # the reward's metrics, when asked for, run after it on the same arguments
    assert _call_in_worker("tests.metrics_divide", here, ("four",), {},
                           "tests.rewards_for_tests:per_character")[:2] == \
        (1.0, ({"per_character": 0.25}, None))
    with pytest.raises(ImportError, match="the caller from /elsewhere"):
        _call_in_worker("tests.length", "/elsewhere/areal_flow/__init__.py", ("x",), {})


def test_a_crash_without_an_exit_code_is_still_described():
    assert _exit_status(None) == "exit code None"
    assert _exit_status(3) == "exit code 3"
    assert _exit_status(-9) == "killed by SIGKILL"


@pytest.mark.faults
def test_workers_never_run_the_callers_main_module(tmp_path, monkeypatch):
    """In process: the caller's __main__ given by path (a script) and by module name (python -m):
    a worker must import neither (a script without a main guard would run again in each)."""
    import types
    from importlib.machinery import ModuleSpec

    marker = tmp_path / "ran.txt"
    body = f"open({str(marker)!r}, 'a').write('ran\\n')\n"
    (tmp_path / "caller_script.py").write_text(body)
    (tmp_path / "caller_main_mod.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_path = types.ModuleType("__main__")
    by_path.__file__, by_path.__spec__ = str(tmp_path / "caller_script.py"), None
    by_name = types.ModuleType("__main__")
    by_name.__spec__ = ModuleSpec("caller_main_mod", None)
    for main in (by_path, by_name):
        monkeypatch.setitem(sys.modules, "__main__", main)
        with RewardRunner(max_workers=1) as r:
            assert score(r, "tests.length", "four") == 4.0
    assert not marker.exists()


@pytest.mark.faults
def test_stats_report_the_mean_seconds_per_call_since_they_were_last_read(caplog):
    with RewardRunner(max_workers=1) as r:
        start = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="areal_flow.reward.runner"):
            assert [score(r, "tests.naps") for _ in range(4)] == [1.0] * 4
        wall = time.perf_counter() - start
        assert caplog.records == []  # calls that scored log nothing
        stats = r.stats()
        assert stats["calls"] == 4 and stats["failure_rate"] == 0.0
        assert 0.05 <= stats["mean_seconds"] <= wall / 4  # each call naps 50 ms
        assert 0.01 < stats["worker_rss_gb"] < 2.0  # a worker's size after its call
        assert r.stats() == {"calls": 0, "timeouts": 0, "crashes": 0, "errors": 0, "invalid": 0,
                             "metrics_errors": 0, "pool_restarts": 0, "recycled_pools": 0,
                             "worker_rss_gb": 0.0, "failure_rate": 0.0, "mean_seconds": 0.0}
    score(r, "tests.length")  # closed: it starts no new workers
    assert r.stats()["pool_restarts"] == 0
    for rate in (0.0, 1.0):  # both ends are valid limits
        RewardRunner(max_failure_rate=rate).close()
    with pytest.raises(ValueError, match="max_failure_rate"):
        RewardRunner(max_failure_rate=-0.1)


@pytest.mark.faults
def test_the_failure_rate_is_per_reward_over_its_last_window_of_calls(monkeypatch):
    """Each reward has its own window of its last FAILURE_WINDOW calls (8 here, for speed); it
    stops the run only when more than the limit failed (exactly the limit does not)."""
    from areal_flow.reward import runner as runner_module

    window = 8
    monkeypatch.setattr(runner_module, "FAILURE_WINDOW", window)
    half = window // 2

    def spec(name):  # one reward under several names: a window each
        return RewardSpec(name=name, fn=rewards_for_tests.fails_on_x)

    with RewardRunner(max_workers=1, max_failure_rate=0.5) as r:
        async def calls(name, texts):
            return [await r.score(spec(name), t) for t in texts]

        # another reward's successes do not dilute this one's failures
        assert asyncio.run(calls("window.a", ["x"] * (half - 1))) == [0.0] * (half - 1)
        assert asyncio.run(calls("window.b", ["ok"] * half)) == [1.0] * half
        with pytest.raises(RewardFailureError, match=rf"failed on {half} of its last {half} "):
            asyncio.run(calls("window.a", ["x"]))
        # older calls leave the window: successes, then failures up to exactly the limit
        assert asyncio.run(calls("window.c", ["ok"] * window + ["x"] * half)) == \
            [1.0] * window + [0.0] * half
        with pytest.raises(RewardFailureError, match=rf"failed on {half + 1} of its last {window} "):
            asyncio.run(calls("window.c", ["x"]))


@pytest.mark.faults
def test_a_leaking_reward_is_contained_by_recycling_its_workers():
    """A reward that keeps 20 MB per call in a global grows its worker without bound; over the
    size limit the workers are replaced (calls in flight finish), so a worker stays within the
    limit plus one call's growth, every call still scores, and the size is in stats()."""
    leak = 20 * 2**20
    with RewardRunner(max_workers=1, max_worker_rss_gb=0) as unbounded:
        first = asyncio.run(unbounded.score("tests.leaks", "x"))
        base = unbounded.stats()["worker_rss_gb"] * 2**30
        for _ in range(6):
            asyncio.run(unbounded.score("tests.leaks", "x"))
        grown = unbounded.stats()["worker_rss_gb"] * 2**30
    assert first == 1.0 and grown >= base + 6 * leak * 0.9  # it does leak

    limit = base + 2.5 * leak
    with RewardRunner(max_workers=1, max_worker_rss_gb=limit / 2**30) as runner:
        scores, sizes, recycled = [], [], 0
        for _ in range(12):
            scores.append(asyncio.run(runner.score("tests.leaks", "x")))
            stats = runner.stats()
            sizes.append(stats["worker_rss_gb"] * 2**30)
            recycled += stats["recycled_pools"]
    assert scores == [1.0] * 12
    assert max(sizes) <= limit + 1.5 * leak, (limit, sizes)
    assert recycled >= 3  # 12 calls at about 3 per worker


def descendants() -> int:
    found, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                kids = [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
            except OSError:
                continue
            found, todo = found + len(kids), todo + kids
    return found


@pytest.mark.faults
def test_replaced_workers_exit_and_a_burst_over_the_limit_replaces_them_once():
    """Calls finishing together over the limit (they ran on one pool) replace it once, and the
    replaced workers exit once their calls are done: the process tree does not grow."""
    with RewardRunner(max_workers=2, max_worker_rss_gb=0) as probe:
        asyncio.run(probe.score("tests.length", "x"))
        base = probe.stats()["worker_rss_gb"] * 2**30
    limit = base + 1.5 * 20 * 2**20

    async def burst(runner):
        return await asyncio.gather(*(runner.score("tests.leaks", "x") for _ in range(4)))

    with RewardRunner(max_workers=2, max_worker_rss_gb=limit / 2**30) as runner:
        asyncio.run(burst(runner))
        runner.stats()  # counted from here
        processes = descendants()  # the forkserver and two workers
        for _ in range(4):
            assert asyncio.run(burst(runner)) == [1.0] * 4
            assert runner.stats()["recycled_pools"] <= 1
        deadline = time.monotonic() + 15
        while descendants() > processes and time.monotonic() < deadline:
            time.sleep(0.1)  # a retired pool's workers exit once their calls are done
        assert descendants() <= processes


def test_a_worker_is_replaced_after_its_calls():
    with RewardRunner(max_workers=1, max_calls_per_worker=3, max_worker_rss_gb=0) as runner:
        pids = [asyncio.run(runner.score("tests.worker_pid", "x")) for _ in range(7)]
    assert [len(set(pids[i:i + 3])) for i in (0, 3, 6)] == [1, 1, 1]
    assert len(set(pids)) == 3, pids  # a new worker for each three calls


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_calls_per_worker": -1}, "must be >= 0"), ({"max_worker_rss_gb": -0.5}, "must be >= 0")])
def test_bad_recycling_limits_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardRunner(**kwargs)
