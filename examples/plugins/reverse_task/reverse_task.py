"""A whole custom RL task in one file: reverse the word in the prompt."""

from areal_flow import reward, workflow


@reward("reverse.exact", timeout=2.0, range=(0.0, 1.0))
def exact(completion: str, *, word: str) -> float:
    """1 when the completion's first line is the word reversed, else 0."""
    lines = completion.strip().splitlines()
    return float(bool(lines) and lines[0].strip() == word[::-1])


@workflow("reverse.single_turn")
async def single_turn(ctx, sample: dict):
    prompt = ctx.chat([{"role": "user", "content": f"Reverse the word: {sample['word']}"}])
    out = await ctx.generate(prompt)
    score = await ctx.reward("reverse.exact", out.text, word=sample["word"])
    return ctx.episode(prompt, out, reward=score)
