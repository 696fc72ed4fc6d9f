"""A real text gymnasium.Env for the `env` workflow's tests, registered with gymnasium when
imported (so ``gymnasium.make("tests.environments_for_tests:GuessNumber-v0")`` works in any
process, the recipe's included)."""

from __future__ import annotations

import re
import string

import gymnasium
from gymnasium.spaces import Text

TEXT = Text(max_length=4096, charset=string.printable)


class GuessNumber(gymnasium.Env):
    """Guess a whole number from 1 to `high`; the env says "Higher." or "Lower." and ends the
    episode when the guess is right. The row's `target`, if it has one, is the number; otherwise
    the seed draws it. Reward: 1 when right; with `graded`, 0.5 * closeness for a wrong number."""

    metadata = {"render_modes": []}

    def __init__(self, high: int = 10, graded: bool = False):
        self.high, self.graded = high, graded
        self.observation_space, self.action_space = TEXT, TEXT

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        target = (options or {}).get("target")
        self.target = int(target) if target is not None else \
            int(self.np_random.integers(1, self.high + 1))
        self.guesses = 0
        return f"I picked a whole number from 1 to {self.high}. Guess it.", {"seed": seed}

    def step(self, action):
        found = re.search(r"-?\d+", action)
        self.guesses += 1
        info = {"metrics": {"guesses": self.guesses, "solved": 0.0}, "target": self.target}
        if found is None:
            return "Reply with a number.", 0.0, False, False, info
        guess = int(found.group())
        if guess == self.target:
            info["metrics"]["solved"] = 1.0
            return "Correct!", 1.0, True, False, info
        closeness = max(0.0, 1.0 - abs(guess - self.target) / self.high)
        hint = "Higher." if guess < self.target else "Lower."
        return hint, 0.5 * closeness if self.graded else 0.0, False, False, info


gymnasium.register("GuessNumber-v0", entry_point=GuessNumber)
