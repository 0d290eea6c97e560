"""What is the sampler's device path's own (sampler.sample_on_device: what
samples logits that live on a GPU): a seeded row's device generator is made
once and kept, and on CUDA, where there is one, sample() sends the logits
there.  Everything else -- distributions, greedy rows, processors, rows that
fail alone, logprobs -- runs in tests/test_sampler.py on all three paths
(its ``sampler_path`` fixture), the device path on CPU tensors."""

import pytest
import torch

from interlace.engine_ext.native import sampler
from interlace.engine_ext.native.sampler import sample, sample_on_device
from test_sampler import LOGITS, SETTINGS, assert_fits, gen, ids, target

N = 20_000


def draw(settings, vocab, seed=0, device="cpu", fn=sample_on_device):
    rng = torch.Generator().manual_seed(seed)
    names = [name for _ in range(N) for name in settings]
    gens = [gen(rng, temperature=t, top_k=k, top_p=p) for name in names for t, k, p in [settings[name]]]
    row = torch.full((vocab,), float("-inf"))
    row[ids(vocab)] = torch.tensor(LOGITS)
    out = fn(row.repeat(len(gens), 1).to(device), gens)
    got = {name: [] for name in settings}
    for name, (tok, lp) in zip(names, out):
        got[name].append(tok)
    return got


def run(rows, at, steps=20, seed=0, device="cpu"):
    """Row ``at``'s tokens over ``steps`` steps of the batch ``rows``; row ``at``
    gets the same logits in every run, the others random ones."""
    gens = [gen(**kw) for kw in rows]
    mine = torch.Generator().manual_seed(99)
    noise = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        logits = torch.randn(len(rows), 4096, generator=noise) * 2
        logits[at] = torch.randn(4096, generator=mine) * 2
        out.append(sample_on_device(logits.to(device), gens)[at][0])
    return out, gens[at]


@pytest.mark.parametrize("mine", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
                                  dict(temperature=0.9, top_k=50, top_p=0.95)])
def test_seeded_row_is_reproducible_anywhere_beside_anything(mine, device="cpu"):
    mine = dict(mine, seed=7)
    alone, g = run([mine], 0, device=device)
    assert g.device_rng is not None and g.device_rng.device.type == device  # made once, kept on the generation
    others = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.2, top_k=600, seed=3),
              dict(temperature=0.7, top_p=0.5), dict(temperature=1.0, top_p=0.99, seed=8, logprobs=True)]
    assert run(others[:3] + [mine] + others[3:], 3, seed=1, device=device)[0] == alone
    assert run(others[::-1] + [mine], 5, seed=2, device=device)[0] == alone
    assert run([mine, dict(temperature=0.5)], 0, seed=3, device=device)[0] == alone
    assert run([dict(mine, seed=70)], 0, device=device)[0] != alone  # random, and the seed is what fixes it
    assert len(set(alone)) > 5


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
def test_on_cuda_sample_samples_there(monkeypatch):
    """sample() sends CUDA logits to the device path; each setting follows its distribution there, seeded rows
    reproduce, and the generators it makes are CUDA generators."""
    monkeypatch.setattr(sampler, "_draw", None)  # the CPU race must not be reached
    got = draw(SETTINGS, 64, seed=3, device="cuda", fn=sample)
    for name, setting in SETTINGS.items():
        assert_fits(got[name], target(setting, 64))
    test_seeded_row_is_reproducible_anywhere_beside_anything(dict(temperature=0.8, top_p=0.9), device="cuda")
