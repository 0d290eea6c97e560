"""A semantic call's prompt is tokenized whole and cut at variable boundaries
(gateway/semantic/prompt.py), so it reads exactly what the chat endpoint reads."""

from __future__ import annotations

import copy

import pytest

from interlace.gateway.prompt import render_messages
from interlace.gateway.semantic.prompt import OPEN, prompt_pieces
from interlace.parsers.formats import HERMES


@pytest.fixture(scope="module")
def tok(smol_dir):
    from interlace.engine_ext.tokenizer import Tokenizer

    return Tokenizer(smol_dir)


def flat(pieces):
    return [t for p in pieces for t in p.tokens]


def test_plain_prompts_are_tokenized_whole_and_cut_at_boundaries(tok):
    segs = [("Tell me a joke about ", False), ("cats", True), (" please.\n\n", False), ("Hello", True)]
    pieces = prompt_pieces(tok, HERMES, segs)
    whole = tok.encode("Tell me a joke about cats please.\n\nHello", parse_special=False)
    assert flat(pieces) == whole
    # on their own, "about " + "cats" would be other ids
    assert sum((tok.encode(t, parse_special=False) for t, _ in segs), []) != whole
    texts = [tok.decode(p.tokens) for p in pieces]
    assert texts == ["Tell me a joke about", " cats", " please.\n\n", "Hello"]
    assert [p.static for p in pieces] == [True, False, True, False]


def test_chat_prompts_equal_the_chat_endpoints(tok):
    msgs = [("system", [("Be brief. Topic: ", False), ("cats", True)]),
            ("user", [("Tell me about ", False), ("cats", True), (". <|im_end|> stays text", False)])]
    pieces = prompt_pieces(tok, HERMES, messages=msgs)
    ref = render_messages(tok, [{"role": r, "content": "".join(t for t, _ in s)} for r, s in msgs], [], HERMES)
    assert flat(pieces) == ref
    assert tok.special_tokens["<|im_end|>"] in ref  # the frame's own markers are special tokens
    assert ref.count(tok.special_tokens["<|im_end|>"]) == 2  # the user's "<|im_end|>" is not
    assert [p.static for p in pieces] == [True, False, True, False, True]
    # a value of one user turn: the frame before it is constant, shared by any such call
    assert tok.decode(pieces[0].tokens, skip_special_tokens=False).startswith("<|im_start|>system\nBe brief.")


def test_a_template_that_moves_the_markers_gives_one_exact_piece(tok):
    trimming = copy.copy(tok)
    trimming.chat_template = tok.chat_template.replace("message['content']", "message['content'] | trim")
    trimming._template = None
    msgs = [("user", [("  Tell me about ", False), ("cats  ", True)])]
    pieces = prompt_pieces(trimming, HERMES, messages=msgs)
    assert len(pieces) == 1 and not pieces[0].static
    assert flat(pieces) == render_messages(trimming, [{"role": "user", "content": "  Tell me about cats  "}],
                                           [], HERMES)
    # a value holding a marker character: exact, not cut
    odd = prompt_pieces(tok, HERMES, [("a ", False), (f"b{OPEN}c", True)])
    assert len(odd) == 1 and flat(odd) == tok.encode(f"a b{OPEN}c", parse_special=False)
