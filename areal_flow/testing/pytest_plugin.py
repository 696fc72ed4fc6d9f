"""pytest plugin (entry point ``pytest11``), loaded in any environment with areal-flow installed.

Third-party packages test their rewards with one line::

    def test_my_reward(reward_contract):
        reward_contract("my_task.exact")
"""

from __future__ import annotations

import pytest


@pytest.fixture
def reward_contract():
    """``reward_contract(name_or_spec, max_examples=200)``: assert the reward contract holds."""
    # imported here so that merely having areal-flow installed costs pytest nothing at start-up
    from areal_flow.testing.contract import assert_reward_contract

    return assert_reward_contract
