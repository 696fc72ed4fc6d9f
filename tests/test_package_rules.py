"""Package-wide rules: light imports, no dispatch on type strings, references that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import run_python

PACKAGE = Path(__file__).resolve().parents[1] / "areal_flow"
ROOT = PACKAGE.parent


def test_importing_the_public_api_and_the_decorators_does_not_import_torch():
    out = run_python(
        """
        import sys
        import areal_flow, areal_flow.config, areal_flow.registry, areal_flow.types
        import areal_flow.reward, areal_flow.workflow, areal_flow.algorithms
        import areal_flow.testing.pytest_plugin
        from areal_flow import Episode, reward, workflow, algorithm
        print(sorted(m for m in ("torch", "transformers", "tensordict") if m in sys.modules))
        """
    )
    assert out.stdout.strip() == "[]"


SELECTOR_WORDS = ("type", "kind", "backend", "algorithm", "name", "mode")


def _selector(node: ast.AST) -> str | None:
    ident = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    if ident and not ident.startswith("__") and any(word in ident.lower() for word in SELECTOR_WORDS):
        return ident
    return None


def dispatch_sites(tree: ast.AST) -> list[str]:
    """`x_type == "..."` comparisons, `match` on string literals, and {"name": Class} tables."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and all(
            isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops
        ):
            sides = [node.left, *node.comparators]
            has_str = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides)
            names = [_selector(s) for s in sides if _selector(s)]
            if has_str and names:
                found.append(f"line {node.lineno}: comparison of {names[0]} with a string")
        elif isinstance(node, ast.Match):
            for case in node.cases:
                if isinstance(case.pattern, ast.MatchValue) and isinstance(
                    getattr(case.pattern.value, "value", None), str
                ):
                    found.append(f"line {node.lineno}: match on a string")
        elif isinstance(node, ast.Dict):
            classes = [
                k for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
                and isinstance(v, ast.Name) and v.id[:1].isupper()
            ]
            if len(classes) >= 2:
                found.append(f"line {node.lineno}: a dict of names to classes")
    return found


def test_the_dispatch_check_recognises_each_pattern():
    code = (
        'if backend == "sglang":\n    pass\n'
        'match kind:\n    case "grpo":\n        pass\n'
        'ALGOS = {"grpo": GRPO, "ppo": PPO}\n'
    )
    assert len(dispatch_sites(ast.parse(code))) == 3


def test_nothing_is_dispatched_by_comparing_a_type_string():
    offenders = {
        str(path.relative_to(PACKAGE)): sites
        for path in PACKAGE.rglob("*.py")
        if (sites := dispatch_sites(ast.parse(path.read_text())))
    }
    assert offenders == {}, "select by name through the registry instead"


def test_a_run_needs_neither_hypothesis_nor_matplotlib_and_their_commands_name_the_extra(
        tmp_path):
    """Test and plotting libraries are extras (`contract`, `plot`): the core and a recipe's
    imports load without them, and the commands that need them say which extra to install."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        sys.modules["hypothesis"] = sys.modules["matplotlib"] = None  # not installed
        sys.path.insert(0, "recipes")
        import gsm8k_grpo, gsm8k_sft, dpo  # every module a run imports
        import areal_flow.cli
        assert not {{"hypothesis", "matplotlib"}} & {{m.split(".")[0] for m in sys.modules
                                                    if sys.modules[m] is not None}}
        for argv in (["plot", "{tmp_path}"], ["check-reward", "gsm8k"]):
            assert areal_flow.cli.main(argv) == 2, argv
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pip install 'areal-flow[plot]'" in done.stderr
    assert "pip install 'areal-flow[contract]'" in done.stderr


PATH_NAMED = re.compile(
    r"(?<![\w/.-])((?:areal_flow|docs|tests|scripts|recipes|benchmarks|examples)/[\w./-]*\w)(?![\w{])")
"""A repository path as help text, docstrings and docs name it (`areal_flow/run.py`)."""


def stale_references(text: str) -> list[str]:
    """The paths `text` names that do not exist here (placeholders such as NAME or <task>
    excepted), and any DESIGN.md: the design document is not part of the repository."""
    named = [m.group(1) for m in PATH_NAMED.finditer(text)]
    return sorted({path for path in named if "NAME" not in path and not (ROOT / path).exists()}
                  | ({"DESIGN.md"} if "DESIGN.md" in text else set()))


def test_the_reference_check_finds_a_moved_file_and_the_design_document():
    text = ("see `areal_flow/run.py` and areal_flow/gsm8k_rl.py (DESIGN.md), "
            "benchmarks/NAME.py, recipes/gsm8k_{grpo,ppo}.py")
    assert stale_references(text) == ["DESIGN.md", "areal_flow/gsm8k_rl.py"]


def test_every_path_the_code_and_the_docs_name_exists():
    """Help text (docstrings and field docs become --help), comments and the docs name files
    that exist: a move that leaves a reference behind fails here."""
    texts = [*PACKAGE.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
             ROOT / "benchmarks" / "README.md", *(ROOT / "recipes").glob("*.py"),
             *(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts").glob("*.sh"),
             ROOT / "pyproject.toml"]
    stale = {str(path.relative_to(ROOT)): found for path in texts
             if (found := stale_references(path.read_text()))}
    assert stale == {}


def module_level_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level: definitions, assignments and imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_every_name_in_a_modules_all_is_defined_there():
    """`from module import *` raises AttributeError on a name `__all__` lists and the module
    lacks (a leftover of splitting a module in two)."""
    missing = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    getattr(t, "id", None) == "__all__" for t in node.targets):
                listed = {elt.value for elt in node.value.elts}
                if absent := sorted(listed - module_level_names(tree)):
                    missing[str(path.relative_to(ROOT))] = absent
    assert missing == {}
