"""Log-probs and entropy computed only at the loss positions, in chunks, from the rows packed end
to end, equal the full-vocabulary computation at every position of the right-padded rows: values
and parameter gradients (random tiny models, fp32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from areal_flow.runtime import logprobs
from areal_flow.runtime.layout import PackedRows
from areal_flow.runtime.logprobs import LossPositions, loss_position_head


@st.composite
def problems(draw):
    vocab = draw(st.integers(8, 40))
    config = LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=draw(st.integers(1, 2)), num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=draw(st.booleans()))
    rows, width = draw(st.integers(1, 4)), draw(st.integers(2, 10))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    attention = torch.arange(width)[None, :] < lengths[:, None]
    loss_mask = attention & (torch.rand(rows, width, generator=g) < 0.6)
    return {
        "config": config, "seed": seed,
        "ids": torch.randint(0, vocab, (rows, width), generator=g),
        "attention": attention, "loss_mask": loss_mask,
        "temperature": torch.tensor(draw(st.lists(st.sampled_from([0.6, 1.0, 1.7]),
                                                  min_size=rows, max_size=rows))),
        "chunk_tokens": draw(st.integers(1, 5)),
        # weights of the logprob and entropy terms of a made-up loss, for the gradients
        "a": torch.randn(rows, width, generator=g), "b": torch.randn(rows, width, generator=g),
    }


def full_reference(model, p):
    """Every position of the padded rows, the whole vocabulary: the straightforward computation."""
    logits = model(input_ids=p["ids"], attention_mask=p["attention"].long()).logits
    logp = torch.log_softmax(logits[:, :-1].float() / p["temperature"][:, None, None], -1)
    token = logp.gather(-1, p["ids"][:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    pad = torch.nn.functional.pad
    mask = p["loss_mask"].clone()
    mask[:, 0] = False
    return pad(token, (1, 0)) * mask, pad(entropy, (1, 0)) * mask


def at_loss_positions(model, p, entropy_mode):
    layout = PackedRows.of(p["ids"], p["attention"])
    where = LossPositions.of(layout, p["loss_mask"], p["temperature"])
    with loss_position_head(model, where, entropy_mode) as extra:
        out = model(**layout.model_inputs()).logits
    token, ent = (out[:, 0], out[:, 1]) if entropy_mode == "grad" else (out, extra["entropy"])
    shape = p["ids"].shape
    return where.scatter(token, shape), (None if ent is None else where.scatter(ent, shape))


def grads(model) -> dict[str, torch.Tensor]:
    return {n: q.grad.clone() if q.grad is not None else torch.zeros_like(q)
            for n, q in model.named_parameters()}


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # setattr each example
@given(p=problems(), entropy_mode=st.sampled_from(["grad", "metric"]))
def test_loss_position_logprobs_equal_the_full_computation(p, entropy_mode, monkeypatch):
    # small chunks, so that a row's positions span several
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", p["chunk_tokens"] * p["config"].vocab_size)
    torch.manual_seed(p["seed"])
    model = LlamaForCausalLM(p["config"]).float()

    ref_token, ref_entropy = full_reference(model, p)
    loss = (ref_token * p["a"]).sum() + (ref_entropy * p["b"]).sum() * (entropy_mode == "grad")
    loss.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)

    token, entropy = at_loss_positions(model, p, entropy_mode)
    torch.testing.assert_close(token, ref_token, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert entropy.requires_grad == (entropy_mode == "grad")
    loss = (token * p["a"]).sum() + ((entropy * p["b"]).sum() if entropy_mode == "grad" else 0)
    loss.backward()
    got = grads(model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_no_entropy_is_computed_when_none_is_asked(tiny_model_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    mask = torch.ones_like(ids, dtype=torch.bool)
    layout = PackedRows.of(ids, mask)
    where = LossPositions.of(layout, mask, torch.ones(2))
    with loss_position_head(model, where, "none") as extra:
        out = model(**layout.model_inputs()).logits
    assert out.shape == (2 * 5,) and extra["entropy"] is None
    # the model's own head is back afterwards
    assert model(input_ids=ids).logits.shape == (2, 6, model.config.vocab_size)


def two_rows():
    """Rows of 3 and 2 tokens (right-padded to 4), with the loss mask set everywhere, padding
    and position 0 included: only (0, 1), (0, 2) and (1, 1) have a log-prob to read."""
    ids = torch.tensor([[5, 6, 3, 0], [2, 4, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    layout = PackedRows.of(ids, attention)
    return layout, LossPositions.of(layout, torch.ones(2, 4, dtype=torch.bool),
                                    torch.tensor([0.5, 2.0]))


def test_a_loss_mask_on_padding_or_position_0_reads_nothing():
    _, where = two_rows()
    assert list(zip(where.rows.tolist(), where.cols.tolist())) == [(0, 1), (0, 2), (1, 1)]
    assert where.targets.tolist() == [6, 3, 4] and where.temperature.tolist() == [0.5, 0.5, 2.0]
    # each is predicted by the packed hidden state of the token before it
    assert where.states.tolist() == [0, 1, 3]


@pytest.mark.parametrize("tokens_per_chunk", [1, 2])
def test_a_head_with_a_bias_in_chunks_of_at_most_chunk_elements_logits(tokens_per_chunk,
                                                                        monkeypatch):
    """Any `nn.Linear` head (its bias included), each chunk at most CHUNK_ELEMENTS logits and
    every position in exactly one chunk: the values of the plain full-vocabulary computation."""
    vocab = 7
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", tokens_per_chunk * vocab)
    chunks = []

    def recording(hidden, *args):
        chunks.append(len(hidden))
        return chunk(hidden, *args)

    chunk = logprobs._chunk
    monkeypatch.setattr(logprobs, "_chunk", recording)
    torch.manual_seed(0)
    head = torch.nn.Linear(4, vocab, bias=True)
    torch.nn.init.normal_(head.bias, std=3.0)
    layout, where = two_rows()
    hidden = torch.randn(1, 5, 4)
    token, entropy = logprobs.head_at_positions(head, hidden, where, "metric")
    assert all(1 <= n <= tokens_per_chunk for n in chunks) and sum(chunks) == 3
    with torch.no_grad():
        logits = head(hidden[0])[[0, 1, 3]] / torch.tensor([[0.5], [0.5], [2.0]])
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(token, dist.log_prob(torch.tensor([6, 3, 4])))
    torch.testing.assert_close(entropy, dist.entropy())


def test_scatter_keeps_the_values_dtype():
    _, where = two_rows()
    out = where.scatter(torch.tensor([0.25, -1.5, 3.0], dtype=torch.float64), torch.Size((2, 4)))
    assert out.dtype == torch.float64
    assert out.tolist() == [[0.0, 0.25, -1.5, 0.0], [0.0, 3.0, 0.0, 0.0]]


@pytest.mark.parametrize("entropy_mode", ["none", "metric", "grad"])
def test_no_loss_position_gives_empty_outputs_still_in_the_graph(entropy_mode):
    layout, _ = two_rows()
    where = LossPositions.of(layout, torch.zeros(2, 4, dtype=torch.bool), torch.ones(2))
    head = torch.nn.Linear(4, 7)
    hidden = torch.randn(1, 5, 4, requires_grad=True)
    token, entropy = logprobs.head_at_positions(head, hidden, where, entropy_mode)
    assert token.shape == (0,) and token.requires_grad  # FSDP's hooks need a graph to run
    assert (entropy is None) == (entropy_mode == "none")
    if entropy is not None:
        assert entropy.shape == (0,) and entropy.requires_grad == (entropy_mode == "grad")
    token.sum().backward()
    assert hidden.grad is not None and not hidden.grad.any()


@pytest.mark.parametrize("entropy_mode", ["none", "metric", "grad"])
def test_backward_keeps_no_logits_and_recomputes_them(entropy_mode):
    """What the forward saves for backward is the head's inputs and a number per position,
    never a [positions, vocab] tensor: the logits are recomputed in backward."""
    vocab = 11
    layout, where = two_rows()
    head = torch.nn.Linear(4, vocab)
    hidden = torch.randn(1, 5, 4, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        token, entropy = logprobs.head_at_positions(head, hidden, where, entropy_mode)
    assert saved and not [s for s in saved if len(s) == 2 and s[-1] == vocab]
    linears = []
    forward = torch.nn.functional.linear
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.nn.functional, "linear", lambda *a: linears.append(1) or forward(*a))
        (token.sum() + (entropy.sum() if entropy_mode == "grad" else 0)).backward()
    assert linears == [1] and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_mode", ["grad", "metric"])
def test_the_head_equals_the_categorical_distribution(dtype, entropy_mode):
    check_head_against_categorical(dtype, entropy_mode)


def check_head_against_categorical(dtype, entropy_mode, device="cpu", vocab=50, n=9, width=16,
                                   fp32_tolerance=1e-5):
    """The written-out log-softmax, entropy and gradient, in the training dtypes: log-probs,
    entropies and the gradients of the hidden states, the weight and the bias against
    torch.distributions' Categorical in fp64 on the CPU (tests/test_gpu.py runs it on a GPU)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocab).to(dtype)
    hidden = torch.randn(1, n + 1, width, dtype=dtype)
    ids = torch.randint(0, vocab, (1, n + 1))
    mask = torch.ones(1, n + 1, dtype=torch.bool)
    a, b = torch.randn(n), torch.randn(n)

    on = head.to(device)
    x = hidden.to(device, copy=True).requires_grad_()
    where = LossPositions.of(PackedRows.of(ids.to(device), mask.to(device)), mask.to(device),
                             torch.tensor([0.7], device=device))
    token, entropy = logprobs.head_at_positions(on, x, where, entropy_mode)
    (token * a.to(device)).sum().add(
        (entropy * b.to(device)).sum() if entropy_mode == "grad" else 0).backward()
    got = [token.detach(), entropy.detach(), x.grad, on.weight.grad, on.bias.grad]
    assert all(t.device.type == torch.device(device).type for t in got)

    h = hidden.double().requires_grad_()  # a copy: never the tensor that x is
    w, bias = (t.detach().cpu().double().requires_grad_() for t in (on.weight, on.bias))
    dist = torch.distributions.Categorical(logits=(h[0, :-1] @ w.t() + bias) / 0.7)
    ref_token, ref_entropy = dist.log_prob(ids[0, 1:]), dist.entropy()
    (ref_token * a.double()).sum().add(
        (ref_entropy * b.double()).sum() if entropy_mode == "grad" else 0).backward()
    expected = [ref_token, ref_entropy, h.grad, w.grad, bias.grad]
    tol = fp32_tolerance if dtype is torch.float32 else 3e-2
    for name, g, e in zip(["token", "entropy", "hidden", "weight", "bias"], got, expected):
        torch.testing.assert_close(g.cpu().double(), e, atol=tol, rtol=tol, msg=name)
