"""Streaming detokenization never emits broken UTF-8 and adds up to the full text."""

from hypothesis import given, settings
from hypothesis import strategies as st

from interlace.engine_ext.tokenizer import IncrementalDetokenizer

SAMPLES = ["naïve café — 東京 🚀🚀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ", "def f(x):\n    return x ** 2  # ✓", "  leading spaces\tand\ttabs"]


def check(tok, text, prefix=()):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, list(prefix))
    deltas = [d.add(i) for i in ids]
    deltas.append(d.flush())
    full = tok.decode(ids)
    if "\ufffd" not in full:  # (a character the vocabulary cannot spell decodes to U+FFFD anyway)
        assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == full


def test_multibyte_samples(smol_engine):
    for s in SAMPLES:
        check(smol_engine.tokenizer, s)
        check(smol_engine.tokenizer, s, prefix=smol_engine.tokenizer.encode("Answer: "))


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_any_text_roundtrips(smol_engine, text):
    check(smol_engine.tokenizer, text)
