"""The sampler's device path (sampler.sample_on_device: what samples logits
that live on a GPU), run here on CPU tensors with CPU generators -- it is
plain torch ops -- and, where there is one, on CUDA: each setting follows
its exact distribution in a mixed batch, a seeded row is reproducible
wherever it sits, greedy rows are argmax, processors run on their rows only
(on the host) and a raising one or a NaN row fails alone, logprobs are
log_softmax of the processed row.  The helpers and targets are
test_sampler.py's."""

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


@pytest.mark.parametrize("vocab", [8, 64])
def test_mixed_batch_gives_each_row_its_own_distribution(vocab):
    got = draw(SETTINGS, vocab, seed=2)
    for name, setting in SETTINGS.items():
        assert_fits(got[name], target(setting, vocab))


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


def test_greedy_rows_are_argmax_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    greedy = [0, 2, 5]
    want = logits[greedy].argmax(-1).tolist()
    for others in ({}, dict(temperature=1.0), dict(temperature=2.0, top_k=40, top_p=0.9)):
        gens = [gen(**(dict(temperature=0.0) if i in greedy else dict(others, seed=i))) for i in range(6)]
        got = sample_on_device(logits, gens)
        assert [got[i][0] for i in greedy] == want
        if others:
            assert [t for i, (t, _) in enumerate(got) if i not in greedy] != [logits[i].argmax().item()
                                                                             for i in range(6) if i not in greedy]


def test_processors_run_on_their_rows_only_and_a_raising_one_fails_its_row():
    calls = []

    def only(tok):
        def proc(generated, row):
            calls.append((tok, list(generated), row.clone()))
            row[:] = float("-inf")  # in place: the caller's logits must not change
            row[tok] = 0.0
            return row
        return proc

    def then_plus(generated, row):
        calls.append(("plus", list(generated), row.clone()))
        return row + 1.0

    def boom(generated, row):
        raise ValueError("broken processor")

    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    before = logits.clone()
    gens = [gen(temperature=1.0), gen(temperature=1.0, logits_processors=[only(7)]),
            gen(temperature=0.0, logits_processors=[only(11), then_plus], logprobs=True),
            gen(temperature=1.0, logits_processors=[only(3), boom]), gen(temperature=0.0)]
    gens[1].generated.extend([4, 5])
    out = sample_on_device(logits, gens)
    assert out[1] == (7, None)
    assert out[2][0] == 11 and abs(out[2][1]) < 1e-6
    assert out[3][0] == -1 and isinstance(out[3][1], ValueError)
    assert out[4] == (int(logits[4].argmax()), None)
    assert 0 <= out[0][0] < 50
    assert [(c[0], c[1]) for c in calls] == [(7, [4, 5]), (11, []), ("plus", []), (3, [])]
    assert torch.equal(calls[0][2], before[1]) and torch.equal(calls[1][2], before[2])
    assert calls[2][2][11] == 0.0 and torch.isinf(calls[2][2]).sum() == 49  # "plus" got only(11)'s row
    assert torch.equal(logits, before)


@pytest.mark.parametrize("vocab", [50, 49152])
def test_a_row_with_nothing_to_sample_fails_alone(vocab):
    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    logits[1] = float("-inf")
    logits[2, 7] = float("nan")
    logits[3, 9] = float("inf")
    logits[4, :-1] = float("-inf")  # one token left: it is the draw
    out = sample_on_device(logits, [gen(temperature=1.0, top_p=p, top_k=k, logprobs=True, seed=i)
                                    for i, (p, k) in enumerate([(1.0, 0), (1.0, 0), (0.9, 0), (1.0, 5), (0.5, 3),
                                                                (0.9, 40)])])
    assert [t for t, _ in out] == [out[0][0], -1, -1, -1, vocab - 1, out[5][0]]
    assert all(isinstance(e, ValueError) for _, e in out[1:4])
    assert out[0][0] >= 0 and out[5][0] >= 0 and out[4][1] == 0.0


def test_logprobs_are_log_softmax_of_the_processed_row():
    def halve(generated, row):
        return row * 0.5

    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    kws = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.3, top_k=20),
           dict(temperature=1.0, top_p=0.8, logits_processors=[halve]),
           dict(temperature=0.0, logits_processors=[halve]),
           dict(temperature=1.0, top_k=5, top_p=0.5, logits_processors=[halve])]
    gens = [gen(logprobs=True, **kw) for kw in kws]
    processed = logits.clone()
    processed[[3, 4, 5]] *= 0.5
    ref = torch.log_softmax(processed.double(), -1)
    for _ in range(10):
        for i, (tok, lp) in enumerate(sample_on_device(logits, gens)):
            assert abs(lp - ref[i, tok].item()) < 1e-5
    assert sample_on_device(logits, [gen(**kw) for kw in kws])[1][1] is None


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
