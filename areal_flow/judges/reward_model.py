"""A learned reward model (a Hugging Face sequence classifier with one output) scoring texts in
the rollout process.

`RewardModel(path)` loads ``AutoModelForSequenceClassification`` (``num_labels=1``) and its
tokenizer; `await rm.score(x)` scores one chat (a list of messages, rendered with the model's
chat template) or one text. Calls made concurrently (the episodes of a group) are gathered into
one padded batch, run in a worker thread under a lock, so the event loop keeps serving
generation while the model runs. Workflows use it as ``await ctx.reward_model(messages,
model=path)``; `load(path)` keeps one model per path in the process.

Needs torch and transformers (imported when a model is loaded, never by ``import areal_flow``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

_LOADED: dict[tuple[str, str], RewardModel] = {}
_LOAD_LOCK = threading.Lock()


class RewardModel:
    """Scores (prompt, completion) chats with a sequence-classification model.

    Args:
        path: a local folder or hub id of a model with one output (``num_labels=1``).
        device: where the model runs ("cpu", "cuda", ...).
        dtype: the torch dtype name of its weights ("float32", "bfloat16").
        max_batch_size: most texts scored in one forward pass.
        max_length: texts are truncated to this many tokens (None: the model's own limit).
    """

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32",
                 max_batch_size: int = 16, max_length: int | None = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=getattr(torch, dtype)).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {self.path!r} has num_labels="
                             f"{self.model.config.num_labels}; a reward model has one output")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_length = max_length
        self.forward_calls = 0
        """Forward passes run so far (one per batch)."""
        self._lock = threading.Lock()
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._flushing = False

    def text(self, messages_or_text: str | list[dict[str, Any]]) -> str:
        """What the model reads: a chat rendered by its chat template, or the text itself."""
        if isinstance(messages_or_text, str):
            return messages_or_text
        return self.tokenizer.apply_chat_template(messages_or_text, tokenize=False)

    def score_batch(self, texts: list[str]) -> list[float]:
        """Blocking: the model's scalar output for each text, in one padded forward pass."""
        import torch

        with self._lock, torch.inference_mode():
            enc = self.tokenizer(texts, return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None,
                                 max_length=self.max_length, add_special_tokens=False)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            logits = self.model(**enc).logits
            self.forward_calls += 1
        return [float(x) for x in logits[:, 0].float().cpu()]

    async def score(self, messages_or_text: str | list[dict[str, Any]]) -> float:
        """The reward of one chat or text; concurrent calls share a forward pass."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((self.text(messages_or_text), future))
        if not self._flushing:
            self._flushing = True
            loop.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # let the calls made in the same tick join the batch
            while self._pending:
                batch = self._pending[: self.max_batch_size]
                del self._pending[: self.max_batch_size]
                try:
                    scores = await asyncio.to_thread(self.score_batch, [t for t, _ in batch])
                except Exception as exc:  # every caller of the batch sees the error
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), value in zip(batch, scores, strict=True):
                    if not future.done():  # a caller that was cancelled is skipped
                        future.set_result(value)
        finally:
            self._flushing = False


def load(path: str, **kwargs: Any) -> RewardModel:
    """The process's `RewardModel` for `path` (loaded on first use, then shared)."""
    key = (str(path), repr(sorted(kwargs.items())))
    with _LOAD_LOCK:
        if key not in _LOADED:
            _LOADED[key] = RewardModel(path, **kwargs)
        return _LOADED[key]


__all__ = ["RewardModel", "load"]
