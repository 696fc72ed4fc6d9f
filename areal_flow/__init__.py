"""areal_flow: asynchronous RL post-training for LLMs (torch-free import, for reward workers)."""

from areal_flow.algorithms import algorithm
from areal_flow.registry import algorithms, generation_pools, rewards, workflows
from areal_flow.reward import reward
from areal_flow.types import (Algorithm, Completion, Episode, GenerationPool, GenerationRequest,
                              LossOutput, ModelOutput, SamplingParams, WeightUpdate)
from areal_flow.workflow import workflow
from areal_flow.workflow.context import RolloutContext

__version__ = "0.1.0"

__all__ = ["Algorithm", "Completion", "Episode", "GenerationPool", "GenerationRequest",
           "LossOutput", "ModelOutput", "RolloutContext", "SamplingParams", "WeightUpdate",
           "algorithm", "algorithms", "generation_pools", "reward", "rewards", "workflow",
           "workflows"]
