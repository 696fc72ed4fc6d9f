"""The core imports no optional part (docs/architecture.md, "The map").

The optional parts reach the core through the registries and entry points (a workflow, a
reward, an algorithm, a dataset source, a logger); a core API that hands over to one imports it
inside the function, at one of the `DOORS` below, so that a run which does not ask never loads
it. Imports under `if TYPE_CHECKING:` are for annotations and load nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "areal_flow"

OPTIONAL = {
    # module, or package (every module under it): what it is, and the extra that installs it
    "areal_flow.launch": "launch: --allocation, SLURM jobs, leases, --dry-run",
    "areal_flow.agents": "agents: the OpenAI-compatible endpoint, environments, tools, "
                         "verifiers ([agents], [verifiers])",
    "areal_flow.judges": "judges: an LLM judge, a reward model",
    "areal_flow.extra_algorithms": "further algorithms: DPO, distillation, REINFORCE++",
    "areal_flow.evaluation": "`areal-flow eval`",
    "areal_flow.plot": "`areal-flow plot` ([plot])",
    "areal_flow.protocol_server": "the SGLang-protocol server (`areal-flow serve`)",
    "areal_flow.testing": "the reward contract kit ([contract]), the tiny test model",
    "areal_flow.data.reasoning_gym": "reasoning-gym rows ([reasoning-gym])",
    "areal_flow.data.packaged": "the offline demo's SmolLM2 and GSM8K file ([demo])",
    "areal_flow.lora": "LoRA adapters through peft ([lora])",
    "areal_flow.reward.reasoning_gym": "reasoning-gym's reward ([reasoning-gym])",
    "areal_flow.loggers": "trackers: tensorboard, wandb ([trackers])",
    "areal_flow.cli": "the `areal-flow` commands",
}

DOORS = {
    # (core module, optional module it imports inside a function): the core API that asks
    ("areal_flow.workflow.context", "areal_flow.agents.openai_endpoint"):
        "ctx.openai_client(), ctx.openai_server(), ctx.recorded_episode()",
    ("areal_flow.rollout.scheduler", "areal_flow.agents.openai_endpoint"):
        "the scheduler's endpoint, made when a first episode opens a client",
    ("areal_flow.workflow.context", "areal_flow.judges.judge"): "ctx.judge()",
    ("areal_flow.workflow.context", "areal_flow.judges.reward_model"): "ctx.reward_model()",
    ("areal_flow.inference.sglang_pool", "areal_flow.launch.lease"):
        "leases on servers the pool did not launch (`from_config`)",
    ("areal_flow.inference.sglang_servers", "areal_flow.launch.lease"):
        "a server another run holds is not admitted (the pool was given leases)",
    ("areal_flow.rl_recipes", "areal_flow.launch.allocation"): "a run given --allocation",
    ("areal_flow.rl_recipes", "areal_flow.extra_algorithms.distill"):
        "a run given --teacher: the teacher's tokenizer checked against --model's",
    ("areal_flow.session", "areal_flow.data.packaged"): "a run that leaves --model unset",
    ("areal_flow.data.offline", "areal_flow.data.packaged"): "a run that leaves --dataset unset",
    ("areal_flow.runtime.engine", "areal_flow.lora"): "a TrainEngine given --train.lora.rank",
    ("areal_flow.runtime.checkpoint", "areal_flow.lora"): "saving a LoRA policy",
    ("areal_flow.runtime.weight_sync", "areal_flow.lora"): "a LoRA adapter synced as a folder",
    ("areal_flow.inference.engine_weights", "areal_flow.lora"): "an engine sent an adapter",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def is_optional(module: str) -> bool:
    return any(module == part or module.startswith(part + ".") for part in OPTIONAL)


def imports(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(loaded with the module, loaded inside its functions): the areal_flow modules named by
    its import statements; `from package import name` counts as the module `name` where there
    is one. Imports under `if TYPE_CHECKING:` count as neither."""
    at_import, inside = set(), set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES
                 else node.module for alias in node.names] if node.module else []
            found = {name for name in names if name.split(".")[0] == "areal_flow"}
            (inside if in_function else at_import).update(found)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return at_import, inside


GRAPH = {name: imports(ast.parse(path.read_text())) for name, path in MODULES.items()}
CORE = sorted(name for name in MODULES if not is_optional(name))


def test_every_optional_part_and_door_names_a_module_that_exists():
    for part in OPTIONAL:
        assert any(name == part or name.startswith(part + ".") for name in MODULES), part
    for core, optional in DOORS:
        assert core in CORE and optional in MODULES and is_optional(optional)


def test_no_core_module_loads_an_optional_part():
    loaded = {core: sorted(name for name in GRAPH[core][0] if is_optional(name))
              for core in CORE}
    assert {core: names for core, names in loaded.items() if names} == {}, \
        "reach the optional part through a registry, or import it where it is asked for (DOORS)"


def test_the_core_imports_an_optional_part_only_at_a_door():
    inside = {(core, name) for core in CORE for name in GRAPH[core][1] if is_optional(name)}
    assert inside - set(DOORS) == set(), "a new door: name it in DOORS with the API that asks"
    assert set(DOORS) - inside == set(), "a door that is no longer used: drop it"


def test_what_the_default_recipe_loads_is_core():
    """The modules recipes/gsm8k_grpo.py (and the SGLang pool) load when imported, following
    module-level imports: none is optional."""
    recipe = imports(ast.parse((ROOT / "recipes" / "gsm8k_grpo.py").read_text()))[0]
    seen, todo = set(), [*recipe, "areal_flow.inference.sglang_pool"]
    while todo:
        name = todo.pop()
        while name not in MODULES:  # `import areal_flow.x.y` loads the packages above it too
            name = name.rsplit(".", 1)[0]
        if name in seen:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [*GRAPH[name][0], *parents]
    assert sorted(name for name in seen if is_optional(name)) == []
    assert "areal_flow.rl_recipes" in seen and "areal_flow.inference.local" in seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_level_import_circles():
    graph = {name: {m for m in GRAPH[name][0] if m in MODULES and m != name}
             for name in MODULES}
    assert cycles(graph) == []
