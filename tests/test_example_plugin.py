"""examples/plugins/reverse_task, installed for real with pip, is listed and resolved."""

from __future__ import annotations

from tests.helpers import run_cli, run_python


def test_plugins_lists_the_installed_example_with_its_distribution(example_plugin_path):
    rows = [line for line in run_cli("plugins", paths=(example_plugin_path,)).stdout.splitlines()
            if "reverse." in line]
    cells = [[c.strip() for c in row.strip("│ ").split("│")] for row in rows]
    assert cells == [
        ["workflow", "reverse.single_turn", "areal-flow-reverse-task 0.1.0",
         "reverse_task:single_turn"],
        ["reward", "reverse.exact", "areal-flow-reverse-task 0.1.0", "reverse_task:exact"],
    ]


def test_plugins_does_not_list_it_when_it_is_not_installed():
    assert "reverse." not in run_cli("plugins").stdout


def test_the_registry_resolves_the_installed_plugin(example_plugin_path):
    out = run_python(
        """
        import inspect, sys
        from areal_flow import rewards, workflows
        exact = rewards.spec("reverse.exact")
        flow = workflows.spec("reverse.single_turn")
        print(exact.fn("olleh\\nmore", word="hello"), exact.timeout, exact.range)
        print(inspect.iscoroutinefunction(flow.fn), flow.fn.__module__, "torch" in sys.modules)
        """,
        example_plugin_path,
    )
    assert out.stdout.splitlines() == ["1.0 2.0 (0.0, 1.0)", "True reverse_task False"]
