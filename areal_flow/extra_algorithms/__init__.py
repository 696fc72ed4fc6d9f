"""The further algorithms, an optional part: DPO and its preference pairs (`dpo`,
`preference`), on-policy distillation from a teacher (`distill`) and REINFORCE++
(`reinforce_pp`). They reach the core through the `algorithms` registry (`--algorithm NAME`),
as a plugin's algorithm does; the core's are GRPO, PPO and SFT (`areal_flow/algorithms/`)."""
