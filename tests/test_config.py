"""Config classes fail early and clearly, load from files, and render as a tyro CLI."""

from __future__ import annotations

import ast
import inspect
import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout

import attrs
import pytest
import tyro

from areal_flow import config
from areal_flow.config import ConfigError, OptimizerConfig, PolicyLossConfig, RolloutConfig

CLASSES = [RolloutConfig, PolicyLossConfig, OptimizerConfig]


@attrs.frozen
class RecipeConfig:
    """A recipe's one config object."""

    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    loss: PolicyLossConfig = attrs.field(factory=PolicyLossConfig)
    optim: OptimizerConfig = attrs.field(factory=OptimizerConfig)


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (RolloutConfig, {"max_staleness": -1}, "'max_staleness' must be >= 0: -1"),
        (RolloutConfig, {"batch_size": 0}, "'batch_size' must be >= 1: 0"),
        (RolloutConfig, {"group_size": 0}, "'group_size' must be >= 1: 0"),
        (RolloutConfig, {"group_size": 4, "min_group_size": 5}, "'min_group_size' must be <="),
        (RolloutConfig, {"group_size": 8, "max_concurrent": 4}, "'max_concurrent' must be >="),
        (PolicyLossConfig, {"eps_clip": 0.0}, "'eps_clip' must be > 0.0: 0.0"),
        (PolicyLossConfig, {"eps_clip_high": -0.1}, "'eps_clip_high' must be > 0.0"),
        (PolicyLossConfig, {"dual_clip": 1.0}, "'dual_clip' must be > 1.0: 1.0"),
        (PolicyLossConfig, {"importance_weight_cap": 0.5}, "'importance_weight_cap' must be >"),
        (PolicyLossConfig, {"aggregation": "batch"}, "'aggregation' must be in"),
        (OptimizerConfig, {"lr": 0.0}, "'lr' must be > 0.0"),
        (OptimizerConfig, {"betas": (0.9, 1.0)}, "must be < 1.0"),
        (OptimizerConfig, {"max_grad_norm": -1.0}, "'max_grad_norm' must be > 0.0"),
    ],
)
def test_a_bad_value_fails_naming_the_field_and_the_allowed_range(cls, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**kwargs)


def test_structure_reports_every_problem_with_its_path():
    with pytest.raises(ConfigError) as err:
        config.structure(
            RecipeConfig,
            {"rollout": {"max_staleness": -1}, "loss": {"typo_field": 1},
             "optim": {"warmup_steps": "ten"}},
        )
    msg = str(err.value)
    assert "'max_staleness' must be >= 0: -1 @ RecipeConfig.rollout" in msg
    assert "extra fields found (typo_field) @ RecipeConfig.loss" in msg
    assert "expected int @ RecipeConfig.optim.warmup_steps" in msg


def test_yaml_and_json_files_round_trip(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "rollout:\n  group_size: 8\n  max_staleness: 0\nloss:\n  dual_clip: 3.0\n"
        "optim:\n  betas: [0.8, 0.95]\n"
    )
    loaded = config.load(RecipeConfig, tmp_path / "run.yaml")
    assert loaded.rollout.group_size == 8 and loaded.rollout.max_staleness == 0
    assert loaded.loss.dual_clip == 3.0 and loaded.optim.betas == (0.8, 0.95)
    config.dump(loaded, tmp_path / "saved.json")
    assert json.loads((tmp_path / "saved.json").read_text())["rollout"]["group_size"] == 8
    assert config.load(RecipeConfig, tmp_path / "saved.json") == loaded
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        config.load(RecipeConfig, tmp_path / "list.yaml")


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings, read from the class source independently of tyro."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def cli_output(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        tyro.cli(RecipeConfig, args=args)
    text = out.getvalue() + err.getvalue()
    # undo the help box's layout: borders and line wrapping
    return exit_.value.code, " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_help_shows_every_field_with_its_help_text_and_default(monkeypatch):
    # under 130 columns: one column of groups (side by side, their lines would interleave)
    monkeypatch.setenv("COLUMNS", "120")
    code, text = cli_output(["--help"])
    assert code == 0
    for section, cls in [("rollout", RolloutConfig), ("loss", PolicyLossConfig),
                         ("optim", OptimizerConfig)]:
        assert cls.__doc__.split(" (")[0] in text
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in attrs.fields(cls)}, "every field needs help text"
        for field in attrs.fields(cls):
            flag = f"--{section}.{field.name.replace('_', '-')}"
            assert flag in text, flag
            assert docs[field.name] in text, docs[field.name]
        assert f"(default: {RolloutConfig().group_size})" in text


def test_the_cli_rejects_a_bad_value_naming_the_field(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    code, text = cli_output(["--rollout.max-staleness", "-1"])
    assert code != 0
    assert "'max_staleness' must be >= 0: -1" in text
    assert tyro.cli(RecipeConfig, args=["--loss.dual-clip", "3"]).loss.dual_clip == 3.0
