"""The text of a generate stream on the embedded model (it has a real
tokenizer): held-back stop-string prefixes around a pause, and special
tokens with ``skip_special_tokens``."""

from helpers import run
from interlace.engine_ext.constraints.forced import ForcedOutput
from interlace.engine_ext.protocol import SamplingParams

IM_START, IM_END, END_OF_TEXT = 1, 2, 0  # SmolLM2's special tokens


def test_explicit_pause_flushes_held_text_and_resume_does_not_replay_it(smol_engine):
    """While 'XXX...' may still become the stop string, its text is held back.
    A pause ends that (the tool output follows, not more model text): the
    held text comes with the pause event, never after the tool's output."""
    tok = smol_engine.tokenizer
    x = tok.encode("X")
    assert len(x) == 1
    forced = ForcedOutput([tok.encode("Hi") + x * 30, tok.encode(" done")], end_token_id=IM_END)
    sp = SamplingParams(max_tokens=80, stop=["X" * 100], logits_processors=[forced])

    async def go():
        await smol_engine.fill("h", tok.encode_chat([{"role": "user", "content": "Say hi"}]))
        before, after, paused = [], [], False
        try:
            async for ev in smol_engine.generate("h", sp):
                (after if paused else before).append(ev)
                if ev.paused:
                    paused = True
                    forced.on_resume()
                    await smol_engine.resume("h", tok.encode(" [tool output] "))
                elif not paused and ev.token_id == x[0] and sum(e.token_id == x[0] for e in before) == 1:
                    await smol_engine.pause("h")
        finally:
            await smol_engine.free_context("h")
        return before, after

    before, after = run(go())
    assert before[-1].paused
    n_x = sum(e.token_id == x[0] for e in before)
    assert n_x >= 1
    assert "".join(e.text for e in before) == "Hi" + "X" * n_x
    assert "".join(e.text for e in after) == " done"
    assert after[-1].finish_reason == "stop"


def _forced_text(smol_engine, tokens, end, **kw):
    forced = ForcedOutput([tokens], end_token_id=end)

    async def go():
        await smol_engine.fill("s", smol_engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
        try:
            evs = [e async for e in smol_engine.generate(
                "s", SamplingParams(max_tokens=20, logits_processors=[forced], **kw))]
        finally:
            await smol_engine.free_context("s")
        assert evs[-1].finish_reason == "stop" and evs[-1].token_id == end
        return "".join(e.text for e in evs)

    return run(go())


def test_skip_special_tokens(smol_engine):
    tok = smol_engine.tokenizer
    body = [IM_START] + tok.encode("assistant\nHi") + [IM_START]
    assert _forced_text(smol_engine, body, IM_END) == "assistant\nHi"  # the default, as vLLM
    shown = _forced_text(smol_engine, body, IM_END, skip_special_tokens=False)
    assert shown == "<|im_start|>assistant\nHi<|im_start|>"  # the EOS that ended it is not text
    # a stop token id ends generation the same way: not part of the text either
    shown = _forced_text(smol_engine, body, END_OF_TEXT, skip_special_tokens=False,
                         stop_token_ids=[END_OF_TEXT])
    assert shown == "<|im_start|>assistant\nHi<|im_start|>"
