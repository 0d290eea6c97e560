"""What is the sampler's device path's own (sampler.sample_on_device: what
samples logits that live on a GPU): a request's device generator is made
once and kept, and on CUDA, where there is one, sample() sends the logits
there.  Everything else -- distributions, seeded rows reproducible anywhere,
greedy rows, processors, rows that fail alone, logprobs -- runs in
tests/test_sampler.py on all three paths (its ``sampler_path`` fixture), the
device path on CPU tensors."""

import pytest
import torch

from interlace.engine_ext.native import sampler
from interlace.engine_ext.native.sampler import sample_on_device
from test_sampler import SETTINGS, assert_fits, draw, gen, run, target


def test_a_requests_device_generator_is_made_once_and_kept():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(0))
    mine, greedy = gen(temperature=1.0, seed=7), gen(temperature=0.0)
    sample_on_device(logits, [mine, greedy])
    first = mine.device_rng
    assert first is not None and first.device.type == "cpu"
    sample_on_device(logits, [gen(temperature=1.0), mine])  # another row, another batch: the same generator
    assert mine.device_rng is first and greedy.device_rng is None  # greedy rows draw nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_sample_samples_there(monkeypatch):
    """sample() sends CUDA logits to the device path; each setting follows its distribution there, a seeded
    row reproduces wherever it sits, and the generators it makes are CUDA generators."""
    monkeypatch.setattr(sampler, "_draw", None)  # the CPU race must not be reached
    got = draw(SETTINGS, 64, seed=3, device="cuda")
    for name, setting in SETTINGS.items():
        assert_fits(got[name], target(setting, 64))
    mine = dict(temperature=0.8, top_p=0.9, seed=7)
    alone = run([mine], 0, device="cuda")
    assert run([dict(temperature=1.0), mine, dict(temperature=0.0)], 1, seed=1, device="cuda") == alone
    g = gen(**mine)
    sampler.sample(torch.randn(1, 64, device="cuda"), [g])
    assert g.device_rng.device.type == "cuda"
