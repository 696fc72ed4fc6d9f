"""Hypothesis strategies for testing rewards: hostile text, and numbers written many ways."""

from __future__ import annotations

from decimal import Decimal

try:
    from hypothesis import strategies as st
except ImportError:
    raise ModuleNotFoundError("the reward contract kit generates its cases with hypothesis: pip "
                              "install 'areal-flow[contract]'") from None

# Fragments that answer parsers look for, so random text often reaches their corner cases.
_MARKERS = ["####", "#### ", "\\boxed{", "}", "$", "%", ",", ".", "-", "The answer is", "\n", " "]


@st.composite
def formatted_numbers(draw: st.DrawFn) -> tuple[str, str]:
    """``(canonical, written)``: a number and one way a model might write it.

    `canonical` is the plain decimal form (``"-1234"``, ``"0.5"``); `written` may add thousands
    separators, a ``$`` sign, a trailing ``.0``/``.00`` or a ``%`` sign.
    """
    integer = draw(st.integers(min_value=-10**9, max_value=10**9))
    frac = draw(st.sampled_from(["", "", "5", "25", "125"]))
    value = Decimal(f"{integer}.{frac}") if frac else Decimal(integer)
    canonical = format(value, "f")
    digits = f"{abs(integer):,}" if draw(st.booleans()) else str(abs(integer))
    written = digits + (f".{frac}" if frac else draw(st.sampled_from(["", ".0", ".00"])))
    if draw(st.booleans()):
        written = "$" + written
    elif draw(st.booleans()):
        written += "%"
    return canonical, ("-" if integer < 0 else "") + written


def completion_text() -> st.SearchStrategy[str]:
    """Arbitrary unicode mixed with numbers and answer markers."""
    piece = st.one_of(
        st.text(max_size=40),
        st.sampled_from(_MARKERS),
        formatted_numbers().map(lambda pair: pair[1]),
    )
    return st.one_of(st.text(), st.lists(piece, max_size=12).map("".join))


ANSWER_SYNTAXES = {
    "####": "#### {}",
    "boxed": "\\boxed{{{}}}",
    "answer_tag": "<answer>{}</answer>",
    "json": '{{"answer": "{}"}}',
}
"""How a completion may state its final answer, by name (`answered`'s `syntaxes`)."""


@st.composite
def answered(draw: st.DrawFn, syntaxes: tuple[str, ...] = tuple(ANSWER_SYNTAXES),
             answer_field: str = "answer") -> tuple[str, dict[str, str]]:
    """``(completion, kwargs)`` that reach a reward's main path: hostile text ending in a number
    wrapped in one of `syntaxes`, and the reference answer as ``kwargs[answer_field]`` — the
    completion's own number about half the time."""
    canonical, written = draw(formatted_numbers())
    wrapped = ANSWER_SYNTAXES[draw(st.sampled_from(syntaxes))].format(written)
    reference = canonical if draw(st.booleans()) else draw(formatted_numbers())[0]
    return f"{draw(completion_text())} {wrapped}", {answer_field: reference}
