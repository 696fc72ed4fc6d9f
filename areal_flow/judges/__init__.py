"""Judges, an optional part: a model that grades a completion, either the policy's own pool
asked in words (`judge`, `ctx.judge()`) or a sequence-classification reward model
(`reward_model`, `ctx.reward_model()`). The core loads them only when a reward asks."""
