"""The registry: decorators, entry-point discovery, dotted paths, and every error it promises."""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint

import attrs
import pytest

from areal_flow import algorithm, algorithms, reward, rewards, workflow, workflows
from areal_flow import registry as registry_module
from areal_flow.registry import (
    DuplicateNameError,
    PluginInfo,
    PluginLoadError,
    Registry,
    RegistryError,
    UnknownNameError,
)
from areal_flow.types import AlgorithmSpec, RewardSpec, WorkflowSpec
from tests.helpers import make_distribution, run_cli, run_python

# --------------------------------------------------------------------------- in-process


@reward("test_registry.half", timeout=3.0, default=0.5, range=(0.0, 2.0))
def half(completion: str) -> float:
    return 0.5


@workflow("test_registry.flow")
async def flow(ctx, sample):
    return None


@attrs.frozen
class ToyConfig:
    """Toy."""

    scale: float = 1.0


@algorithm("test_registry.algo", config=ToyConfig)
class ToyAlgorithm:
    roles = ("actor",)


class ToySubclass(ToyAlgorithm):
    pass


def undecorated(completion: str) -> float:
    return 1.0


def test_decorators_return_the_object_unchanged_and_register_its_spec():
    assert half("anything") == 0.5  # still an ordinary function
    spec = rewards.spec("test_registry.half")
    assert spec == RewardSpec(
        name="test_registry.half", fn=half, timeout=3.0, default=0.5, range=(0.0, 2.0)
    )
    assert workflows.spec("test_registry.flow") == WorkflowSpec(name="test_registry.flow", fn=flow)
    assert algorithms.spec("test_registry.algo") == AlgorithmSpec(
        name="test_registry.algo", cls=ToyAlgorithm, config=ToyConfig
    )
    assert "test_registry.half" in rewards.names()


def test_get_gives_the_registered_object_itself_and_spec_its_declarations():
    assert rewards.get("test_registry.half") is half
    assert workflows.get("test_registry.flow") is flow
    assert algorithms.get("test_registry.algo") is ToyAlgorithm
    assert algorithms.get(f"{__name__}:ToyAlgorithm") is ToyAlgorithm  # by path: the same rule
    assert rewards.get(f"{__name__}:undecorated") is undecorated
    assert algorithms.spec("test_registry.algo").config is ToyConfig


def test_unknown_name_lists_known_names_and_the_closest_match():
    with pytest.raises(UnknownNameError) as err:
        rewards.spec("test_registry.hal")
    msg = str(err.value)
    assert "unknown reward 'test_registry.hal'" in msg
    assert "test_registry.half" in msg.split("known:")[1]
    assert "Did you mean 'test_registry.half'?" in msg


def test_dotted_path_fallback_resolves_decorated_and_plain_functions():
    assert rewards.spec(f"{__name__}:half") is rewards.spec("test_registry.half")
    plain = rewards.spec(f"{__name__}:undecorated")
    assert plain == RewardSpec(name=f"{__name__}:undecorated", fn=undecorated)
    with pytest.raises(UnknownNameError, match="could not be imported"):
        rewards.spec(f"{__name__}:missing")


def test_a_subclass_does_not_inherit_its_parents_registration():
    spec = algorithms.spec(f"{__name__}:ToySubclass")
    assert spec.cls is ToySubclass and spec.config is None


def test_one_name_from_two_definitions_is_an_error_naming_both():
    with pytest.raises(DuplicateNameError) as err:

        @reward("test_registry.half")
        def other_half(completion: str) -> float:
            return 0.5

    assert f"{__name__}:half" in str(err.value)
    assert "other_half" in str(err.value)


def test_redefining_the_same_function_replaces_it():
    registry = Registry("thing", "areal_flow.test_nothing")

    def make():
        def thing():
            return 1

        return thing

    first, second = make(), make()
    registry.register("x", first)
    assert registry.get("x") is first  # a lookup caches what it found
    registry.register("x", second)
    assert registry.get("x") is second  # and registering the name again drops that


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="'default' must lie within range"):
        reward("test_registry.bad", default=2.0, range=(0.0, 1.0))(undecorated)
    with pytest.raises(ValueError, match="'timeout' must be > 0"):
        reward("test_registry.bad", timeout=0)(undecorated)
    with pytest.raises(TypeError, match="must be an 'async def' function"):
        workflow("test_registry.sync")(undecorated)


# --------------------------------------------------------------------------- entry points
# Each scenario lays out real installed distributions (.dist-info with entry_points.txt) and
# runs in a fresh interpreter that sees them, exactly as `pip install` would leave things.

PLUGIN_A = """
    from areal_flow import reward
    @reward("task.score", range=(0.0, 1.0))
    def score(completion: str) -> float:
        return 1.0
"""
PLUGIN_B = """
    from areal_flow import reward
    @reward("task.other")
    def other(completion: str) -> float:
        return 0.0
"""


def test_lookup_imports_only_the_entry_point_asked_for(tmp_path):
    site = make_distribution(
        tmp_path,
        "task-plugin",
        {"areal_flow.rewards": {"task.score": "plugin_a:score", "task.other": "plugin_b:other"}},
        {"plugin_a": PLUGIN_A, "plugin_b": PLUGIN_B},
    )
    out = run_python(
        """
        import sys
        from areal_flow import rewards
        assert "plugin_a" not in sys.modules and "plugin_b" not in sys.modules
        assert {"task.other", "task.score"} <= set(rewards.names()), rewards.names()
        spec = rewards.spec("task.score")
        assert spec.fn("x") == 1.0 and spec.range == (0.0, 1.0)
        print(sorted(m for m in ("plugin_a", "plugin_b", "torch") if m in sys.modules))
        """,
        site,
    )
    assert out.stdout.strip() == "['plugin_a']"


def test_one_name_from_two_distributions_is_an_error_naming_both(tmp_path):
    first = make_distribution(
        tmp_path / "one", "first-dist", {"areal_flow.rewards": {"task.score": "plugin_a:score"}},
        {"plugin_a": PLUGIN_A},
    )
    second = make_distribution(
        tmp_path / "two",
        "second-dist",
        {"areal_flow.rewards": {"task.score": "plugin_c:score", "task.other": "plugin_b:other"}},
        {"plugin_c": PLUGIN_A, "plugin_b": PLUGIN_B},
    )
    out = run_python(
        """
        from areal_flow import rewards
        from areal_flow.registry import DuplicateNameError
        try:
            rewards.spec("task.score")
        except DuplicateNameError as exc:
            print(exc)
        print(rewards.spec("task.other").name)  # the other names still resolve
        """,
        first,
        second,
    )
    message, other = out.stdout.strip().splitlines()
    assert "announced by two distributions" in message
    assert "first-dist 0.1" in message and "second-dist 0.1" in message
    assert other == "task.other"


def test_a_broken_plugin_is_named_with_its_distribution_and_breaks_nothing_else(tmp_path):
    site = make_distribution(
        tmp_path,
        "broken-plugin",
        {"areal_flow.rewards": {"task.broken": "broken_mod:score", "task.other": "plugin_b:other"}},
        {"broken_mod": "import not_a_real_module_xyz\n", "plugin_b": PLUGIN_B},
    )
    out = run_python(
        """
        from areal_flow import rewards
        from areal_flow.registry import PluginLoadError
        try:
            rewards.spec("task.broken")
        except PluginLoadError as exc:
            print(exc)
        print(rewards.spec("task.other").fn("x"))
        """,
        site,
    )
    message, other = out.stdout.strip().splitlines()
    assert "reward 'task.broken' from distribution broken-plugin 0.1 failed to load" in message
    assert "No module named 'not_a_real_module_xyz'" in message
    assert other == "0.0"

    listing = run_cli("plugins", paths=(site,))
    assert "task.broken" in listing.stdout and "task.other" in listing.stdout
    checked = run_cli("plugins", "--check", paths=(site,), check=False)
    assert checked.returncode == 1
    assert "failed to load" in checked.stdout and "ok" in checked.stdout


def test_entry_point_and_decorator_names_must_agree(tmp_path):
    site = make_distribution(
        tmp_path, "misnamed", {"areal_flow.rewards": {"task.alias": "plugin_a:score"}},
        {"plugin_a": PLUGIN_A},
    )
    out = run_python(
        """
        from areal_flow import rewards
        from areal_flow.registry import RegistryError
        try:
            rewards.spec("task.alias")
        except RegistryError as exc:
            print(exc)
        """,
        site,
    )
    assert "decorated as 'task.score'" in out.stdout


def test_an_entry_point_may_name_an_undecorated_function(tmp_path):
    site = make_distribution(
        tmp_path, "plain", {"areal_flow.rewards": {"task.plain": "plain_mod:score"}},
        {"plain_mod": "def score(completion):\n    return 1.0\n"},
    )
    out = run_python(
        """
        from areal_flow import rewards
        spec = rewards.spec("task.plain")
        print(spec.name, spec.timeout, spec.default, spec.range)
        """,
        site,
    )
    assert out.stdout.split() == ["task.plain", "10.0", "0.0", "(0.0,", "1.0)"]


def test_in_process_registration_that_shadows_a_plugin_is_an_error(tmp_path):
    site = make_distribution(
        tmp_path, "task-plugin", {"areal_flow.rewards": {"task.score": "plugin_a:score"}},
        {"plugin_a": PLUGIN_A},
    )
    out = run_python(
        """
        from areal_flow import reward, rewards
        from areal_flow.registry import DuplicateNameError
        @reward("task.score")
        def mine(completion):
            return 0.0
        try:
            rewards.spec("task.score")
        except DuplicateNameError as exc:
            print(exc)
        """,
        site,
    )
    assert "task-plugin 0.1" in out.stdout and "__main__:mine" in out.stdout


# --------------------------------------------------------------------------- in process
# The same lookups without a fresh interpreter (so mutation testing sees them): a registry of
# a group of its own over distributions laid out on sys.path, plus in-process registrations.

GROUP = "areal_flow.test_registry_group"


def _rewards_of_group() -> Registry:
    return Registry("reward", GROUP, lambda name, fn: RewardSpec(name=name, fn=fn))


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """Install a distribution announcing `eps` in GROUP, visible to this process only."""

    def install(dist: str, eps: dict[str, str], modules: dict[str, str]):
        root = make_distribution(tmp_path / dist, dist, {GROUP: eps}, modules)
        monkeypatch.syspath_prepend(str(root))

    return install


class Holder:
    @staticmethod
    def score(completion: str) -> float:
        return 2.0


def declared_in_test(completion: str) -> float:
    return 3.0


def test_entry_points_of_a_group_resolve_lazily_and_are_listed_with_their_source(on_path):
    on_path(
        "ep-plugin",
        {"ep.plain": "ep_plain_mod:score", "test_registry.ep_decorated": "ep_decorated_mod:score"},
        {
            "ep_plain_mod": "def score(completion):\n    return 1.0\n",
            "ep_decorated_mod": """
                from areal_flow import reward
                @reward("test_registry.ep_decorated", timeout=2.0)
                def score(completion):
                    return 0.0
            """,
        },
    )
    registry = _rewards_of_group()

    def local_fn(completion):
        return 0.0

    registry.register("local.only", RewardSpec(name="local.only", fn=local_fn))
    assert "ep.plain" in registry and "local.only" in registry and "ep.nope" not in registry
    assert registry.names() == ["ep.plain", "local.only", "test_registry.ep_decorated"]
    assert registry.plugins() == [
        PluginInfo("reward", "ep.plain", "ep-plugin 0.1", "ep_plain_mod:score"),
        PluginInfo("reward", "local.only", "in-process", f"{__name__}:{local_fn.__qualname__}"),
        PluginInfo("reward", "test_registry.ep_decorated", "ep-plugin 0.1", "ep_decorated_mod:score"),
    ]
    assert "ep_plain_mod" not in sys.modules  # listing imports nothing

    import importlib

    plain = registry.spec("ep.plain")  # an undecorated function: wrapped by the registry's rule
    assert plain == RewardSpec(name="ep.plain", fn=importlib.import_module("ep_plain_mod").score)
    assert "ep_decorated_mod" not in sys.modules  # only the name asked for was imported
    decorated = registry.spec("test_registry.ep_decorated")  # its decorator's declarations
    assert decorated.timeout == 2.0 and decorated.fn("x") == 0.0
    assert registry.spec("test_registry.ep_decorated") is decorated

    # Registering the loaded object again in-process (a reloaded module) keeps one row.
    registry.register("ep.plain", plain)
    assert [r.name for r in registry.plugins()].count("ep.plain") == 1
    assert registry.spec("ep.plain") == plain


def test_one_name_from_two_distributions_in_process_names_both_and_their_targets(on_path):
    shared = {"dup_a_mod": "def score(completion):\n    return 1.0\n"}
    on_path("dist-one", {"dup.score": "dup_a_mod:score"}, shared)
    on_path("dist-two", {"dup.score": "dup_b_mod:score", "dup.other": "dup_a_mod:score"},
            {"dup_b_mod": "def score(completion):\n    return 2.0\n"})
    registry = _rewards_of_group()
    with pytest.raises(DuplicateNameError) as err:
        registry.spec("dup.score")
    message = str(err.value)
    # sys.path order: the distribution installed last comes first
    assert "dist-two 0.1 (dup_b_mod:score) and dist-one 0.1 (dup_a_mod:score)" in message
    assert registry.get("dup.other")("x") == 1.0  # the other name still resolves


def test_entry_point_named_unlike_its_decorator_or_shadowed_in_process_is_an_error(on_path):
    on_path(
        "named",
        {"ep.alias": "ep_alias_mod:score", "ep.shadowed": "ep_shadow_mod:score"},
        {
            "ep_alias_mod": """
                from areal_flow import reward
                @reward("test_registry.ep_alias_real")
                def score(completion):
                    return 1.0
            """,
            "ep_shadow_mod": "def score(completion):\n    return 1.0\n",
        },
    )
    registry = _rewards_of_group()
    with pytest.raises(RegistryError, match="decorated as 'test_registry.ep_alias_real'"):
        registry.spec("ep.alias")

    def mine(completion):
        return 0.0

    registry.register("ep.shadowed", RewardSpec(name="ep.shadowed", fn=mine))
    with pytest.raises(DuplicateNameError, match="named 0.1") as err:
        registry.spec("ep.shadowed")
    assert mine.__qualname__ in str(err.value)


def test_a_broken_entry_point_in_process_names_its_distribution(on_path):
    on_path("broken-one", {"ep.broken": "ep_broken_mod:score"},
            {"ep_broken_mod": "import not_a_real_module_xyz\n"})
    with pytest.raises(PluginLoadError, match="from distribution broken-one 0.1 failed to load"):
        _rewards_of_group().spec("ep.broken")


def test_an_entry_point_without_a_distribution_is_listed_as_such(monkeypatch):
    ep = EntryPoint(name="ep.orphan", value="somewhere:fn", group=GROUP)
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [ep] if group == GROUP else [])
    assert _rewards_of_group().plugins() == [
        PluginInfo("reward", "ep.orphan", "an unknown distribution", "somewhere:fn")
    ]


def test_a_spec_registered_in_process_is_found_by_the_objects_path_too():
    registry = _rewards_of_group()
    spec = RewardSpec(name="test_registry.in_test", fn=declared_in_test, timeout=4.0)
    assert registry.register("test_registry.in_test", spec) is declared_in_test
    assert registry.spec(f"{__name__}:declared_in_test") is spec


def test_registries_without_specs_return_objects_as_they_are():
    pools = Registry("pool", "areal_flow.test_nothing")
    assert pools.get(f"{__name__}:undecorated") is undecorated
    first, second = object(), object()
    pools.register("p", first)
    assert pools.plugins() == [PluginInfo("pool", "p", "in-process", f"?:{first!r}")]
    with pytest.raises(DuplicateNameError):  # two distinct objects, however anonymous
        pools.register("p", second)


def test_dotted_path_reaches_nested_attributes_and_blames_the_missing_part():
    registry = _rewards_of_group()
    assert registry.get(f"{__name__}:Holder.score") is Holder.score
    with pytest.raises(UnknownNameError, match="AttributeError"):
        registry.spec(f"{__name__}:Holder:score")  # the module exists, the attribute does not


def test_unknown_name_message_of_an_empty_and_of_a_filled_registry():
    registry = Registry("gadget", "areal_flow.test_nothing")
    with pytest.raises(UnknownNameError) as err:
        registry.spec("x")
    assert str(err.value).startswith("unknown gadget 'x'; known: (none registered)")
    assert str(err.value).endswith("(a 'package.module:attribute' path also works)")
    registry.register("b.two", object())
    registry.register("a.one", object())
    with pytest.raises(UnknownNameError) as err:
        registry.spec("zzz")
    assert "known: a.one, b.two" in str(err.value)


def test_the_plugins_command_never_cuts_a_name_without_a_terminal(capsys):
    from areal_flow import cli, registry

    name = "a_plugin_package.with_a_rather_long_module_name.and_an_even_longer_reward_name"
    registry.rewards.register(name, lambda completion: 0.0)
    try:
        assert cli.main(["plugins"]) == 0
    finally:
        registry.rewards._local.pop(name)
    rows = [line for line in capsys.readouterr().out.splitlines() if name in line]
    assert len(rows) == 1 and "in-process" in rows[0]


def test_plugins_show_lists_a_workflows_and_an_algorithms_options_with_their_help(capsys):
    from areal_flow import cli

    assert cli.main(["plugins", "--show", "rlvr"]) == 0
    out = capsys.readouterr().out
    assert "--question-field" in out and "Dataset field holding the question" in out
    assert "question_field" in out  # how --workflow-config spells it
    assert cli.main(["plugins", "--show", "grpo"]) == 0
    assert "--kl-coef" in (out := capsys.readouterr().out) and "--loss.eps-clip" in out
    assert cli.main(["plugins", "--show", "no_such_thing"]) == 2
    assert "known: " in capsys.readouterr().err


GREET = """
def greet(name: str, times: int = 1) -> int:
    \"\"\"Say hello to NAME, TIMES times.\"\"\"
    for _ in range(times):
        print(f"hello {name}")
    return 3
"""


def test_a_distribution_adds_an_areal_flow_command_and_a_broken_one_is_named(tmp_path):
    """`areal_flow.commands` entry points are `areal-flow` subcommands: the options are the
    function's parameters, the exit status its return value; one that cannot load is listed
    with the reason and, run, exits 2 with it, while the others work."""
    site = make_distribution(
        tmp_path, "greet-plugin",
        {"areal_flow.commands": {"greet": "greet_cmd:greet", "broken": "broken_cmd:run"}},
        {"greet_cmd": GREET, "broken_cmd": "import not_a_real_module_xyz\n"})
    ran = run_cli("greet", "--name", "ada", "--times", "2", paths=(site,), check=False)
    assert (ran.returncode, ran.stdout) == (3, "hello ada\nhello ada\n")
    listing = run_cli("--help", paths=(site,))
    flat = " ".join(listing.stdout.replace("│", " ").split())
    assert "greet Say hello to NAME, TIMES times." in flat
    assert "broken (cannot load: No module named 'not_a_real_module_xyz')" in flat
    assert "plugins List every registered workflow" in flat  # the built-in ones are still there
    broken = run_cli("broken", paths=(site,), check=False)
    assert broken.returncode == 2
    assert "areal-flow broken: No module named 'not_a_real_module_xyz'" in broken.stderr
    assert "Traceback" not in broken.stderr
    plugins = run_cli("plugins", paths=(site,))
    assert any([cell.strip() for cell in line.split("│")[1:4]] ==
               ["command", "greet", "greet-plugin 0.1"]
               for line in plugins.stdout.splitlines()), plugins.stdout


def test_running_one_command_loads_no_other_commands_part():
    out = run_python("""
        import sys
        from areal_flow.cli import main
        assert main(["plugins"]) == 0
        print(sorted(m for m in sys.modules if m.startswith(("areal_flow.launch",
              "areal_flow.evaluation", "areal_flow.plot", "areal_flow.protocol_server",
              "areal_flow.testing"))))
        """)
    assert out.stdout.strip().splitlines()[-1] == "[]"
