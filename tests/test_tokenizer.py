"""Streaming detokenization never emits broken UTF-8 and adds up to the full text; a model
directory's tokenizer loads one way (``Tokenizer.from_model_dir``)."""

import pytest
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


# ------------------------------------------------------------------ Tokenizer.from_model_dir
def _model_dir(path, config=None):
    """A model directory with a word-level tokenizer.json (and ``config`` as its config.json)."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    words = ["[UNK]", "<|endoftext|>", "<|end|>", "Hello", "world"]
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_from_model_dir_reads_the_config_beside_the_tokenizer(tmp_path):
    """The model's config.json counts: its eos ids join the tokenizer's own, and its vocab_size
    (padded past the tokenizer's words) is the vocabulary's size; a config the caller already
    read is used as given; a directory without one still loads."""
    from interlace.engine_ext.tokenizer import Tokenizer

    d = _model_dir(tmp_path / "m", {"vocab_size": 64, "eos_token_id": 2})
    tok = Tokenizer.from_model_dir(str(d))
    assert tok.encode("Hello world") == [3, 4]
    assert tok.eos_token_ids == {1, 2} and tok.vocab_size == 64 and tok.config["vocab_size"] == 64
    given = Tokenizer.from_model_dir(d, {"vocab_size": 8})
    assert given.eos_token_ids == {1} and given.vocab_size == 8
    bare = Tokenizer.from_model_dir(_model_dir(tmp_path / "bare"))
    assert bare.eos_token_ids == {1} and bare.vocab_size == 5 and bare.config == {}


def test_from_model_dir_without_a_tokenizer_json(tmp_path):
    """None where an engine can serve token ids alone; an error naming the directory where the
    caller cannot do without a tokenizer (the openai and vllm engines)."""
    from interlace.engine_ext.tokenizer import Tokenizer

    d = tmp_path / "weights-only"
    d.mkdir()
    (d / "config.json").write_text('{"vocab_size": 64}')
    assert Tokenizer.from_model_dir(d) is None
    with pytest.raises(ValueError) as err:
        Tokenizer.from_model_dir(d, needed_by="the openai engine")
    assert str(err.value) == f"the openai engine needs the model's tokenizer: no tokenizer.json in {d}"


def test_tokenizing_a_big_text_leaves_other_threads_running(smol_dir):
    """Tokenizing runs in a worker thread (a 4 MB count_tokens body, a long prompt); the library's
    ``encode`` held the interpreter lock for all of it, so the event loop stood still for seconds
    (the adversarial run: /health waited 4.8 s).  A ticker thread must keep ticking meanwhile; the
    bound is generous against a loaded machine (without the fix the wait is the whole encode)."""
    import threading
    import time

    from interlace.engine_ext.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(smol_dir)
    text = ("The quick brown fox jumps over the lazy dog, 42 times; naïve café. " * 200_000)[:4_000_000]
    gaps, done = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    try:
        ids = tok.encode(text, parse_special=False)
        pieces = tok.encode_pieces([(text[:1000], True), (text[1000:1_000_000], False)])
    finally:
        done.set()
        ticker.join()
    took = time.perf_counter() - started
    assert len(ids) > 500_000 and pieces[:5] == ids[:5]
    assert max(gaps) < max(1.0, took / 4), (max(gaps), took)
