"""Mutation testing of the core, one module at a time, against the tests that cover it.

    pip install -e '.[mutation]'                      # mutmut 3.8.1
    python scripts/mutation.py                          # every module below (about an hour)
    python scripts/mutation.py areal_flow/registry.py   # one module
    python scripts/mutation.py --show areal_flow/registry.py   # and each survivor's diff
    python scripts/mutation.py --again areal_flow/registry.py  # only its survivors, after new tests

mutmut (https://github.com/boxed/mutmut) puts small realistic bugs into a module — a flipped
operator, an off-by-one, a dropped argument, a constant changed — and runs the tests against each.
Each module runs in a scratch copy of the committed tree (`.mutation/<module>/`, ignored by git)
with only its tests selected (`MODULES`); mutmut maps each test to the functions it calls, so a
mutant runs only the tests that reach it. A mutant no test reaches ("no tests") is a survivor;
one under which the tests hang past mutmut's timeout is caught (a hung suite is a failed one).

The wording of errors, warnings and log lines is not mutated (`raise`, `log.*` and `warnings.warn`
statements, and docstrings): tests match the words that matter by pattern. Mutants that cannot
change behaviour are listed with the reason in `scripts/mutation_equivalent/<module>.toml` and
counted apart; a survivor left standing is explained in the same file's `[survived]` table (a
behaviour only a subprocess or a second rank can show, a display detail) and still counts as
survived. Each module's result goes to `benchmarks/results/mutation/<module>.json` and the
table of all of them to `docs/mutation.md`. It does not run in CI: too slow.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# weights kept from the trainer, copied after sharing, and LoRA adapters, in process: the local
# engine's weight updates (local.py, then engine_weights.py)
ENGINE_WEIGHT_TESTS = [
    *(f"tests/test_runtime_checkpoint.py::test_{name}" for name in (
        "weight_sync_makes_the_local_engine_match_the_trainer",
        "an_in_process_engine_generates_from_the_trainers_tensors",
        "a_copied_update_after_sharing_leaves_the_trainers_tensors_alone")),
    *(f"tests/test_lora.py::test_{name}" for name in (
        "after_lora_steps_the_engine_generates_what_the_merged_model_does",
        "removing_the_adapter_serves_the_base_model_again",
        "the_engine_refuses_an_adapter_that_does_not_fit"))]

# module -> the test files that exercise it in process (subprocess tests cannot see mutants)
MODULES: dict[str, list[str]] = {
    "areal_flow/algorithms/functional.py": ["tests/test_functional.py", "tests/test_ppo.py",
                                            "tests/test_reinforce_pp.py", "tests/test_mismatch.py",
                                            # a recipe in a subprocess: it cannot see the mutant
                                            "--deselect=tests/test_reinforce_pp.py::"
                                            "test_trains_three_steps_through_the_recipe_with_a_kl_penalty"],
    "areal_flow/rollout/scheduler.py": ["tests/test_scheduler.py",
                                        "tests/test_scheduler_properties.py"],
    "areal_flow/runtime/checkpoint.py": ["tests/test_runtime_checkpoint.py"] + [
        # the LoRA paths (the rest of test_lora.py runs recipes and servers)
        f"tests/test_lora.py::test_{name}" for name in (
            "the_export_is_the_merged_model_and_a_peft_adapter",
            "a_lora_checkpoint_holds_the_adapter_only_and_resumes_it")],
    "areal_flow/run.py": ["tests/test_run_dir.py", "tests/test_runtime_checkpoint.py::test_a_run_"
                          "folder_checkpoint_is_marked_whole_pruned_and_resumes_policy_and_critic"],
    # split out of run.py since its row was measured (`run` in benchmarks/results/mutation)
    "areal_flow/stop_request.py": ["tests/test_run_dir.py"],
    "areal_flow/live_display.py": ["tests/test_run_dir.py", "tests/test_task_metrics.py"],
    "areal_flow/reward/runner.py": ["tests/test_reward_runner.py"] + [
        # the first compares _WorkerPopen._launch's source, which mutmut rewrites; the others run
        # scripts in subprocesses, which cannot see the mutant (and fail under mutmut's stats)
        f"--deselect=tests/test_reward_runner.py::test_{name}" for name in (
            "the_worker_popen_is_this_pythons_launch_less_the_main_script",
            "workers_never_import_the_callers_script",
            "workers_import_the_callers_areal_flow_when_started_beside_a_clone",
            "an_async_reward_that_segfaults_is_a_crash_and_the_caller_survives")] + [
        # a mutant that hangs a call waits on a worker, using no CPU time (mutmut's limit)
        "--timeout=30"],
    "areal_flow/inference/local.py": [
        # a mutant that loses a request leaves a test waiting on it without CPU time
        "--timeout=15", "tests/test_local_engine.py", "tests/test_decode_paths.py",
        *ENGINE_WEIGHT_TESTS],
    # the engine's weights and their updates, split out of local.py after its run (its
    # mutation_equivalent file names their first survivors under local.py's names)
    "areal_flow/inference/engine_weights.py": [
        "tests/test_local_engine.py", "tests/test_decode_paths.py", *ENGINE_WEIGHT_TESTS,
        "tests/test_runtime_checkpoint.py::test_the_memory_parts_are_the_weights_gradients_"
        "moments_and_the_engines_copies"],
    # the sampler and the KV batch, split out of local.py
    "areal_flow/inference/sampling.py": ["--timeout=15", "tests/test_local_engine.py",
                                         "tests/test_decode_paths.py"],
    "areal_flow/inference/kv_batch.py": ["--timeout=15", "tests/test_decode_paths.py",
                                         "tests/test_local_engine.py"],
    "areal_flow/registry.py": ["tests/test_registry.py"],
    "areal_flow/runtime/engine.py": [
        "tests/test_engine_steps.py", "tests/test_runtime_checkpoint.py", "tests/test_ppo.py",
        "tests/test_weight_updates.py::test_sync_weights_never_writes_into_the_folder_the_pool_names",
        # the weights a LoRA policy syncs and its reference; the bucketed sync to servers (the
        # pool and the trainer in process, the servers not)
        "tests/test_sglang_pool.py::test_bucketed_weights_over_a_gloo_group"] + [
        f"tests/test_lora.py::test_{name}" for name in (
            "only_the_adapter_trains", "the_export_is_the_merged_model_and_a_peft_adapter",
            "after_lora_steps_the_engine_generates_what_the_merged_model_does",
            "a_lora_policys_reference_is_its_own_base_model",
            "a_lora_checkpoint_holds_the_adapter_only_and_resumes_it")],
    "areal_flow/runtime/microbatch.py": ["tests/test_microbatch.py"] + [
        # the property tests (the rest of test_runtime.py runs torchrun worlds in subprocesses)
        f"tests/test_runtime.py::test_{name}" for name in (
            "micro_batches_cover_every_row_once_within_the_budget",
            "splitting_to_a_count_keeps_rows_and_only_adds_bins",
            "groups_go_whole_to_ranks_and_the_load_is_balanced")],
    "areal_flow/runtime/logprobs.py": ["tests/test_logprobs.py"],
    "areal_flow/data/collate.py": ["tests/test_collate.py"],
    # the pool's routing and resubmission (`inference.sglang_pool` in benchmarks/results/mutation,
    # measured before the pool was split into sglang_routing, sglang_servers and sglang_weights)
    **{module: [
        "tests/test_sglang_pool.py",
        # the pool's requests name the adapter (the pool in process, the servers not)
        "tests/test_lora.py::test_the_sglang_pool_swaps_adapters_and_catches_a_joining_server_up"]
       for module in ("areal_flow/inference/sglang_routing.py",
                      "areal_flow/inference/sglang_servers.py")},
}
# modules mutated in part: the functions (fnmatch patterns of mutmut's mutant names) that carry
# what the issue asked to test; the rest of the module is left unmutated
FUNCTIONS: dict[str, list[str]] = {
    # routing and resubmission: which server a request goes to, what is sent again after an
    # interruption, and how the pieces become one completion
    "areal_flow/inference/sglang_routing.py": [
        f"*{name}__mutmut_*" for name in (
            "ǁ_generate", "ǁ_complete", "ǁ_route", "ǁ_body", "ǁ_post_generate",
            "ǁ_extend", "ǁ_completion", ".x__resubmission_seed", ".x__token_versions",
            ".x__version")],
    "areal_flow/inference/sglang_servers.py": [
        f"*{name}__mutmut_*" for name in ("ǁ_take_out", "ǁ_rotation", "ǁ_answering")],
}
# mutants run at once (default 2, the cores here): more where many mutants hang a test until
# its timeout, using no CPU while they wait
CHILDREN: dict[str, int] = {"areal_flow/inference/local.py": 6,
                            "areal_flow/inference/engine_weights.py": 6,
                            # its tests mostly wait on servers (startup, health, timeouts)
                            "areal_flow/inference/sglang_routing.py": 4,
                            "areal_flow/inference/sglang_servers.py": 4,
                            "areal_flow/inference/sampling.py": 4,
                            "areal_flow/inference/kv_batch.py": 4}
# statements whose mutants would only change wording (see the module docstring)
WORDING = [r"^\s*raise ", r"^\s*(log|logger)\.\w+\(", r"^\s*warnings\.warn\("]
CAUGHT = {"killed", "timeout"}
EQUIVALENT = ROOT / "scripts" / "mutation_equivalent"  # <module>.toml: mutant name = "why"
RESULTS = ROOT / "benchmarks" / "results" / "mutation"  # <module>.json: the latest run's
TABLE = ROOT / "docs" / "mutation.md"


def run_module(module: str, tests: list[str], workdir: Path, commit: str,
               again: list[str] | None = None) -> tuple[dict[str, str], float]:
    """mutmut's verdict per mutant name, and the seconds it took. `again`: only these mutants
    run, in the previous run's folder, against `commit`'s tests (the module must be the same)."""
    # the committed tree, not the working one: a row is of one commit, whatever is being edited
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True,
                             capture_output=True).stdout
    if again is not None:
        source = subprocess.run(["git", "show", f"{commit}:{module}"], cwd=ROOT, check=True,
                                capture_output=True).stdout
        if not (workdir / "mutants").is_dir() or (workdir / module).read_bytes() != source:
            raise SystemExit(f"--again needs the previous run of {module} in {workdir}, of "
                             f"the same {module} as {commit}'s: run it whole")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True)
    with open(workdir / "pyproject.toml", "a") as f:
        f.write(_toml(module, tests))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    patterns = FUNCTIONS.get(module, [])
    children = str(CHILDREN.get(module, 2))
    done = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", children,
                           *(patterns if again is None else again)],
                          cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"mutmut failed on {module}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    listing = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                             cwd=workdir, env=env, capture_output=True, text=True, check=True)
    verdicts = {}
    for line in listing.stdout.splitlines():
        name, sep, verdict = line.strip().rpartition(": ")
        if sep and (not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)):
            verdicts[name] = verdict
    return verdicts, seconds


def _toml(module: str, tests: list[str]) -> str:
    def array(items):
        return "[" + ", ".join("'" + i + "'" for i in items) + "]"  # literal strings: no escapes

    return "\n".join([
        "", "[tool.mutmut]", "source_paths = ['areal_flow']", f"only_mutate = {array([module])}",
        f"pytest_add_cli_args_test_selection = {array(tests)}",
        "pytest_add_cli_args = ['-p', 'no:cacheprovider', '-q', '-x']",
        f"do_not_mutate_patterns = {array(WORDING)}",
        # torch is not fork-safe once a test used it: fork each mutant from a clean server
        "process_isolation = 'forkserver'", ""])


def show(workdir: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=workdir,
                         capture_output=True, text=True).stdout
    return "\n".join(line for line in out.splitlines()[1:] if line[:1] in "+-@ ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"default: all of {', '.join(MODULES)}")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument("--table", action="store_true",
                        help="only rewrite docs/mutation.md from the results and the reasons")
    parser.add_argument("--again", action="store_true",
                        help="run only the last run's survivors again, against the tests of "
                             "HEAD (after adding tests; the module itself must be unchanged)")
    args = parser.parse_args()
    if args.table:
        return write_table()
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; the modules: {', '.join(MODULES)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    for module in args.modules or MODULES:
        stem = module.removeprefix("areal_flow/").removesuffix(".py").replace("/", ".")
        workdir = ROOT / ".mutation" / stem
        previous = RESULTS / f"{stem}.json"
        again = json.loads(previous.read_text())["survivors"] if args.again else None
        verdicts, seconds = run_module(module, MODULES[module], workdir, commit, again)
        counts = Counter(verdicts.values())
        if again is not None:
            # mutmut reports only this run's mutants: the others keep the previous verdicts
            prev = json.loads(previous.read_text())
            seconds += 60 * prev["minutes"]
            verdicts = {n: v for n, v in verdicts.items() if n in set(again)}
            counts = Counter({k: n for k, n in prev["verdicts"].items()
                              if k not in ("survived", "no tests")})
            counts.update(Counter(verdicts.values()))
            commit = f"{prev['commit']} (its survivors again at {commit})"
        reasons, _ = _equivalent(stem)
        stale = sorted(set(reasons) - set(verdicts)) if again is None else []
        if stale:
            print(f"  {EQUIVALENT / (stem + '.toml')} names mutants that no longer exist: {stale}")
        survivors = {n: v for n, v in verdicts.items() if v not in CAUGHT and n not in reasons}
        for name, verdict in sorted(survivors.items()):
            print(f"  survived: {name} ({verdict})")
            if args.show:
                print(re.sub(r"^", "    ", show(workdir, name), flags=re.M))
        result = {"module": module, "stem": stem, "tests": MODULES[module], "commit": commit,
                  "functions": FUNCTIONS.get(module, "all"),
                  "minutes": round(seconds / 60, 1),
                  "verdicts": dict(counts),
                  "equivalent": sorted(n for n in reasons if n in verdicts),
                  "survivors": sorted(survivors)}
        (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(_row(result), flush=True)
    write_table()


def _equivalent(stem: str) -> tuple[dict[str, str], dict[str, str]]:
    """The module's equivalent mutants and its explained survivors, each with the reason."""
    path = EQUIVALENT / f"{stem}.toml"
    reasons = tomllib.loads(path.read_text()) if path.exists() else {}
    survived = reasons.pop("survived", {})
    return reasons, survived


def _row(r: dict) -> str:
    total = sum(r["verdicts"].values())
    live = total - len(r["equivalent"])
    killed = live - len(r["survivors"])
    part = "" if r.get("functions", "all") == "all" else " (the functions in `FUNCTIONS`)"
    return (f"| `{r['module']}`{part} | {total} | {killed} | {len(r['survivors'])} "
            f"({r['verdicts'].get('no tests', 0)} reached by no test) | {len(r['equivalent'])} "
            f"| {killed / max(live, 1):.0%} | {r['minutes']} "
            f"| {r.get('commit', 'an earlier session')} |")


def write_table() -> None:
    """docs/mutation.md from every module's latest result."""
    results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    results.sort(key=lambda r: list(MODULES).index(r["module"]) if r["module"] in MODULES else 99)
    reasons, survivors = [], []
    for r in results:
        equivalent, explained = _equivalent(r["stem"])
        # a survivor shown equivalent since its run counts as equivalent
        r["equivalent"] = sorted({*r["equivalent"], *(set(r["survivors"]) & set(equivalent))})
        r["survivors"] = sorted(set(r["survivors"]) - set(equivalent))
        reasons += [f"- `{name}`: {why}" for name, why in equivalent.items()]
        survivors += [f"- `{n}`: {explained.get(n, 'not explained yet')}" for n in r["survivors"]]
    done = {r["module"] for r in results}
    TABLE.write_text(f"""# Mutation testing

Small realistic bugs put into the core modules one at a time (mutmut 3.8.1), each run against
the tests of its module (`scripts/mutation.py` says how mutants are chosen and which tests run).
Regenerate a row with `python scripts/mutation.py MODULE` (every row: no argument; `--show`
prints each survivor's diff). Not run in CI: too slow. A row names the module as it was when
measured: the pool's routing, measured in `inference/sglang_pool.py`, has since moved unchanged to
`inference/sglang_routing.py` and `inference/sglang_servers.py`; `run.py`'s `StopRequest` and
`LiveDisplay`, to `stop_request.py` and `live_display.py`.

| module | mutants | killed | survived | equivalent | killed of non-equivalent | minutes | commit |
|---|---|---|---|---|---|---|---|
{chr(10).join(_row(r) for r in results)}

Not run to the end yet: {", ".join(f"`{m}`" for m in MODULES if m not in done) or "none"}.

## Equivalent mutants (they cannot change behaviour)

{chr(10).join(reasons) or "none"}

## Survivors, and why each is left standing

{chr(10).join(survivors) or "none"}
""")


if __name__ == "__main__":
    main()
