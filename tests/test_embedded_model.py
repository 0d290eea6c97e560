"""End-to-end on the embedded SmolLM2-135M-Instruct: our engine's greedy
output equals transformers' token for token; chat template, stop strings,
pause strings and the CLI."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run
from interlace.engine_ext.protocol import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
           "List three colours."]


@pytest.fixture(scope="module")
def hf_smol(smol_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(smol_engine, hf_smol, prompt):
    tok = smol_engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}])

    async def go():
        await smol_engine.fill(prompt, ids)
        try:
            return [ev async for ev in smol_engine.generate(prompt, SamplingParams(max_tokens=24))]
        finally:
            await smol_engine.free_context(prompt)

    events = run(go())
    ours = [e.token_id for e in events]
    with torch.no_grad():
        ref = hf_smol.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    # the same tokens and the same length: both stop at the model's EOS (included) or at 24 tokens
    assert ours == ref
    assert events[-1].finish_reason == ("stop" if ours[-1] in smol_engine.eos_token_ids else "length")
    assert "".join(e.text for e in events) == tok.decode(ours)


def test_chat_template_matches_transformers(smol_engine, smol_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smol_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert smol_engine.tokenizer.encode_chat(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True,
                                                                              tokenize=True, return_dict=False)


def test_stop_string_and_pause_on(smol_engine):
    tok = smol_engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])

    async def go():
        await smol_engine.fill("s", ids)
        stopped = [e async for e in smol_engine.generate("s", SamplingParams(max_tokens=30, stop=["Paris"]))]
        await smol_engine.free_context("s")
        await smol_engine.fill("p", ids)
        paused = []
        async for e in smol_engine.generate("p", SamplingParams(max_tokens=30, pause_on=["Paris"])):
            paused.append(e)
            if e.paused:
                await smol_engine.resume("p", tok.encode("? No, sorry: the capital of Italy is"))
        await smol_engine.free_context("p")
        return stopped, paused

    stopped, paused = run(go())
    text = "".join(e.text for e in stopped)
    assert "Paris" not in text and text.startswith("The capital of France is")
    assert stopped[-1].finish_reason == "stop"
    pause_idx = next(i for i, e in enumerate(paused) if e.paused)
    before = "".join(e.text for e in paused[:pause_idx + 1])
    assert before.endswith("Paris")  # nothing decoded past the pause string
    after = "".join(e.text for e in paused[pause_idx + 1:])
    assert "Rome" in after  # decoding went on from the appended tokens


def test_pause_on_carries_the_hint_set_while_decoding(smol_engine):
    """A pause the engine takes by itself (pause_on) waits under the tool
    named by set_pause_hint: the policy sees it, and the duration is learned
    under that name, once (the next pause has no hint left over)."""
    from interlace.engine_ext.protocol import PauseHint

    tok = smol_engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    durations = smol_engine.interception.durations
    seen = []

    async def go():
        await smol_engine.fill("h", ids)
        smol_engine.set_pause_hint("h", PauseHint(tool="ignored"))  # not generating: nothing to hint
        async for e in smol_engine.generate("h", SamplingParams(max_tokens=40, pause_on=["Paris", "Rome"])):
            if not seen and not e.paused:  # decoding: as the gateway does once it parses a call's name
                smol_engine.set_pause_hint("h", PauseHint(tool="capital-lookup", expected_duration_s=7.0))
            if e.paused:
                seen.append(smol_engine.contexts["h"].intercept.hint)
                await asyncio.sleep(0.1)
                await smol_engine.resume("h", tok.encode("? No, sorry: the capital of Italy is"))
        await smol_engine.free_context("h")

    assert durations.estimate("capital-lookup") is None
    run(go())
    assert len(seen) >= 2, "expected a pause on Paris, then on Rome"
    assert seen[0].tool == "capital-lookup" and seen[0].expected_duration_s == 7.0
    assert all(h.tool is None for h in seen[1:])
    assert 0.1 <= durations.estimate("capital-lookup") < 5.0
    with pytest.raises(TypeError):
        smol_engine.set_pause_hint("h", {"tool": "x"})


def test_cli_generate(smol_dir):
    out = subprocess.run([sys.executable, "-m", "interlace.cli", "generate", "What is the capital of France?",
                          "--model", str(smol_dir), "--max-tokens", "12"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "interlace.cli", "generate", "x", "--model", str(smol_dir),
                          "--top-p", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_every_pause_is_planned_even_when_resumed_at_once(smol_engine):
    """A pause the engine takes by itself (pause_on) is decided right after
    the step it paused in, as the simulator decides it: a call resumed
    before the next step was otherwise never planned (its KV simply kept,
    whatever the policy; 4 of 30 calls on the memory-pressure trace)."""
    tok = smol_engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Tell me about the city of Paris in two sentences."}])
    pauses = 0

    async def go():
        nonlocal pauses
        await smol_engine.fill("every", ids)
        async for e in smol_engine.generate("every", SamplingParams(max_tokens=24, pause_on=[" "])):
            if e.paused:
                pauses += 1
                await smol_engine.resume("every", [])  # at once: no await in between
        await smol_engine.free_context("every")

    before = sum(smol_engine.stats["handlings"].values())
    run(go())
    assert pauses >= 5, "expected the model to write several words"
    assert sum(smol_engine.stats["handlings"].values()) - before == pauses
