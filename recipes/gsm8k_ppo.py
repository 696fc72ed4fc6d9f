"""PPO on GSM8K: the loop of recipes/gsm8k_grpo.py with PPO's defaults: a learned critic (GAE
advantages), independent completions instead of groups, an optional frozen reference model for a
KL penalty. The same as `python recipes/gsm8k_grpo.py --algorithm ppo` with these defaults.

    python recipes/gsm8k_ppo.py                       # offline CPU default (packaged model + data)
    python recipes/gsm8k_ppo.py --algorithm.kl-coef 0.05   # adds the reference model
    python recipes/gsm8k_ppo.py --help                # every option
"""

from __future__ import annotations

from typing import Annotated

import attrs
import tyro

from areal_flow import rl_recipes
from areal_flow.algorithms.ppo import PPOConfig
from areal_flow.config import PolicyLossConfig, RolloutConfig
from areal_flow.runtime.distributed import exit_process
from gsm8k_grpo import Config as GRPORecipeConfig  # the script's folder is on sys.path
from gsm8k_grpo import main


@attrs.frozen(kw_only=True)
class Config(GRPORecipeConfig):
    """PPO on GSM8K with a critic. Defaults run offline on a CPU in about 20 minutes."""

    algorithm_name: Annotated[str, tyro.conf.arg(name="algorithm")] = "ppo"
    """A registered algorithm (`areal-flow plugins`) or a 'module:Class' path; its options
    follow as --algorithm.<field>."""
    # PPO needs no groups: 16 independent completions per step, like GRPO's 2 x 8
    rollout: RolloutConfig = RolloutConfig(batch_size=16, group_size=1, max_staleness=1,
                                           max_concurrent=32)
    # as GRPO's: pi_prox from the behavior logprobs, no extra forward (see gsm8k_grpo.py)
    algorithm: PPOConfig = PPOConfig(loss=PolicyLossConfig(recompute_proximal=False))


if __name__ == "__main__":
    main(rl_recipes.cli(Config))
    exit_process()  # skips interpreter finalization, which can abort after a good run
