"""One token per running sequence (own settings and generator) and its behavior logprob."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and behavior logprobs ``log_softmax(logits / T)`` (T = 1 if greedy; full vocab,
    before truncation; float32 math). Few vocab passes: at small batches it is 1/10 of a step."""
    device = logits.device
    temperature = torch.tensor([p.logprob_temperature for p in params], device=device)
    scaled = logits / temperature[:, None]  # float32: the temperatures are
    top = scaled.amax(-1, keepdim=True)
    weights = (scaled - top).exp_()  # softmax(scaled) times its normaliser
    log_norm = (top + weights.sum(-1, keepdim=True).log()).squeeze(1)  # logsumexp(scaled)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    # argmax is another pass over the vocabulary: skipped when no row is greedy (RL batches)
    tokens = (logits.argmax(dim=-1) if len(sampled) < len(params)
              else torch.zeros(len(params), dtype=torch.long, device=device))
    if sampled:
        rows = weights if len(sampled) == len(params) else weights[sampled]
        # truncation sorts the whole vocabulary: only for rows that ask for it
        cut = [row for row, i in enumerate(sampled) if _truncates(params[i])]
        if cut:
            index = torch.tensor([sampled[row] for row in cut], device=device)
            kept = truncate(scaled[index], [params[sampled[row]] for row in cut])
            rows = rows.clone() if rows is weights else rows
            rows[cut] = (kept - top[index]).exp()
        # Inverse CDF: one uniform per row from the row's own CPU generator (so a seed gives
        # the same tokens in any batch and on any device), searched in the cumulative weights
        # where they are; torch.multinomial drew an exponential per vocabulary entry on the
        # CPU, and a row at a time. The first entry above u·total has a positive weight (a
        # zero weight leaves the running sum where it was); u·total rounded up to the total
        # finds none, and then the last token with a weight is the one.
        u = torch.cat([torch.rand(1, generator=generators[i]) for i in sampled]).to(device)
        cdf = rows.cumsum(-1)
        found = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]
        over = found >= cdf.shape[-1]
        if bool(over.any()):
            positions = torch.arange(cdf.shape[-1], device=device)
            found[over] = torch.where(rows[over] > 0, positions, -1).amax(-1)
        tokens[sampled] = found
    return tokens, scaled.gather(1, tokens[:, None]).squeeze(1) - log_norm


def _truncates(p) -> bool:
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def truncate(scaled: torch.Tensor, params: list) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, top-p nucleus and min-p floor."""
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else scaled.shape[-1] for p in params],
                         device=scaled.device)
    top_p = torch.tensor([p.top_p for p in params], device=scaled.device)
    min_p = torch.tensor([p.min_p for p in params], device=scaled.device)
    # a token is dropped when the tokens ranked above it hold more than top_p of the mass (as
    # SGLang's torch sampler: the token that crosses top_p exactly is kept)
    mass_above = sorted_probs.cumsum(-1) - sorted_probs
    drop_sorted = (rank >= top_k[:, None]) | ((mass_above > top_p[:, None]) & (top_p[:, None] < 1))
    drop_sorted |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))
