"""The batched sampler (engine_ext/native/sampler.py): each row is drawn from
exactly its own distribution (temperature, top-k, top-p, both, and top-p
past the first K_CAP candidates), whatever shares its batch; seeded rows
are reproducible at any position beside any neighbours; greedy rows are
argmax; logits processors run on their own rows only and a raising one fails
its row alone; logprobs are log_softmax of the processed row.

The distribution tests are chi-square goodness-of-fit tests against targets
computed here in plain Python, each at significance 1e-8 (24 of them: a
false failure, whatever the seeds, is rarer than 1e-6), with fixed seeds so
that every run draws the same numbers.
"""

import math

import pytest
import torch

from interlace.engine_ext.native import sampler
from interlace.engine_ext.native.sampler import sample
from interlace.engine_ext.native.sequence import Generation
from interlace.engine_ext.protocol import SamplingParams

# chi-square critical values at significance 1e-8 by degrees of freedom (the
# upper 1e-8 quantile, solved from the closed-form survival function for
# integer df; e.g. df=1: 5.73 standard deviations squared)
CRIT = {1: 32.84, 2: 36.84, 3: 40.13, 4: 43.07, 5: 45.79, 6: 48.36, 7: 50.81}

# eight tokens whose rank order is not their id order (a sampler that mixed up
# candidate positions and token ids would pick the wrong tokens)
LOGITS = [0.3, 2.0, -1.0, 1.0, 0.0, 1.5, -0.5, 0.6]
N = 20_000

# name: (temperature, top_k, top_p); top-p boundaries are kept well away from
# the prefix masses, which are noted next to each
SETTINGS = {
    "temperature": (0.7, 0, 1.0),
    "top-k": (1.3, 3, 1.0),
    "top-p": (1.0, 0, 0.8),          # prefix masses .374 .601 .739 .832: 4 tokens
    "top-k+top-p": (2.0, 6, 0.6),    # within the top 6: .272 .484 .649: 3 tokens (4 if top-p ignored top-k)
    "top-p-wide": (1.0, 0, 0.86),    # .739 .832 .900: 5 tokens
    "top-p-all": (1.0, 0, 0.97),     # .900 .951 .981: 7 tokens
}


@pytest.fixture(autouse=True, params=["kernel", "torch", "device"])
def sampler_path(request, monkeypatch):
    """Every test on the three ways rows are drawn: on the CPU, rows without top-k by the compiled
    nucleus kernel (inverse CDF, no sort; engine_ext/native/cpu_matmul.py) or by the torch race
    (wherever the kernel cannot be built); and the device path (``sample_on_device``: what samples
    a GPU's logits, plain torch ops, here on CPU tensors; tests/test_sampler_device.py has what is
    its own)."""
    if request.param == "kernel":
        from interlace.engine_ext.native import cpu_matmul

        if cpu_matmul.load() is None:
            pytest.skip("no C++ compiler: no nucleus kernel")
    monkeypatch.setattr(sampler, "USE_KERNEL", request.param == "kernel")
    if request.param == "device":
        monkeypatch.setitem(globals(), "sample", sampler.sample_on_device)
    return request.param


def gen(rng=None, **kw):
    """A Generation as the engine makes it: a sampled row gets a generator
    seeded from its seed (the engine uses os.urandom without one; tests pass
    ``rng`` to stay deterministic)."""
    sp = SamplingParams(**kw)
    if rng is None and not sp.greedy:
        rng = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
    return Generation(sp, emit=lambda ev: None, rng=rng)


def ids(vocab):
    """Where LOGITS' eight tokens sit in a vocabulary of ``vocab`` (the rest are
    -inf): spread over it, so that the sampler's candidate groups differ."""
    return [(i * 37 + 5) % vocab for i in range(len(LOGITS))] if vocab > len(LOGITS) else list(range(vocab))


def target(setting, vocab=len(LOGITS)):
    """The exact distribution over token ids: softmax(logits / T), cut to the
    top_k most likely, renormalized, then cut to the smallest prefix whose
    mass reaches top_p, renormalized."""
    temperature, top_k, top_p = setting
    z = [v / temperature for v in LOGITS]
    order = sorted(range(len(z)), key=lambda i: -z[i])[:top_k or len(z)]
    w = {i: math.exp(z[i]) for i in order}
    p = {i: w[i] / sum(w.values()) for i in order}
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += p[i]
    probs = [0.0] * vocab
    for i, t in enumerate(ids(vocab)):
        probs[t] = p[i] / mass if i in kept else 0.0
    return probs


def assert_fits(tokens, probs):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).tolist()
    assert all(c == 0 for c, q in zip(counts, probs) if q == 0), (counts, probs)
    n = sum(counts)
    stat = sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs) if q > 0)
    df = sum(q > 0 for q in probs) - 1
    assert stat < CRIT[df], (stat, df, [c for c in counts if c], [round(n * q) for q in probs if q])


def draw(settings, vocab=len(LOGITS), seed=0, device="cpu"):
    """N rows of each setting, interleaved in one batch; the tokens per setting."""
    rng = torch.Generator().manual_seed(seed)
    names = [name for _ in range(N) for name in settings]
    gens = [gen(rng, temperature=t, top_k=k, top_p=p) for name in names for t, k, p in [settings[name]]]
    row = torch.full((vocab,), float("-inf"))
    row[ids(vocab)] = torch.tensor(LOGITS)
    out = sample(row.repeat(len(gens), 1).to(device), gens)
    got = {name: [] for name in settings}
    for name, (tok, lp) in zip(names, out):
        got[name].append(tok)
    return got


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_setting_alone_follows_its_distribution(name):
    assert_fits(draw({name: SETTINGS[name]})[name], target(SETTINGS[name]))


@pytest.mark.parametrize("vocab", [8, 64])
@pytest.mark.parametrize("name", ["temperature", "top-p-wide", "top-p-all"])
def test_rows_reaching_past_k_cap_stay_exact(monkeypatch, name, vocab):
    """With K_CAP = 2: a temperature row picks past its 2 candidates through
    the racer that stands for the rest of the vocabulary; a top-p row whose 2
    candidates hold less than top_p ranks more tokens (by a full sort at
    vocab 8; by grouped then plain topk at 64); each still follows its exact
    distribution, not one cut at K_CAP."""
    monkeypatch.setattr(sampler, "K_CAP", 2)
    monkeypatch.setattr(sampler, "USE_KERNEL", False)  # K_CAP is the CPU torch path's, whatever the fixture says
    monkeypatch.setitem(globals(), "sample", sampler.sample)
    widths = []
    topk = sampler._topk
    monkeypatch.setattr(sampler, "_topk", lambda x, k: widths.append(k) or topk(x, k))
    got = draw({name: SETTINGS[name]}, vocab, seed=1)
    assert widths[0] == 2 and (len(widths) > 1) == name.startswith("top-p"), widths
    assert_fits(got[name], target(SETTINGS[name], vocab))


@pytest.mark.parametrize("vocab", [8, 64])
def test_mixed_batch_gives_each_row_its_own_distribution(monkeypatch, vocab):
    monkeypatch.setattr(sampler, "K_CAP", 2)
    got = draw(SETTINGS, vocab, seed=2)
    for name, setting in SETTINGS.items():
        assert_fits(got[name], target(setting, vocab))


@pytest.mark.parametrize("vocab, k", [(49152, 256), (49152, 50), (4096, 256), (1000, 7), (64, 2), (50257, 300)])
def test_grouped_topk_is_torch_topk(vocab, k):
    """sampler._topk (which ranks only the best groups of tokens) gives
    torch.topk's values, and indices that hold them, ties included."""
    g = torch.Generator().manual_seed(vocab + k)
    for x in (torch.randn(5, vocab, generator=g), torch.randint(0, 20, (5, vocab), generator=g).float()):
        x[0, : vocab // 2] = float("-inf")
        vals, idx = sampler._topk(x, k)
        assert torch.equal(vals, torch.topk(x, k).values)
        assert torch.equal(x.gather(1, idx), vals) and all(len(set(r)) == k for r in idx.tolist())


def run(rows, at, steps=20, seed=0, device="cpu"):
    """The tokens of row ``at`` over ``steps`` decode steps of the batch
    ``rows`` (SamplingParams kwargs).  Row ``at`` gets the same logits in
    every run, the others random ones.  4096 tokens: rows race over their
    K_CAP candidates, plain ones through the racer for the rest too, and
    top-p ones (of these flat logits) widen."""
    gens = [gen(**kw) for kw in rows]
    mine = torch.Generator().manual_seed(99)
    noise = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        logits = torch.randn(len(rows), 4096, generator=noise) * 2
        logits[at] = torch.randn(4096, generator=mine) * 2
        out.append(sample(logits.to(device), gens)[at][0])
    return out


@pytest.mark.parametrize("mine", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
                                  dict(temperature=0.9, top_k=50, top_p=0.95)])
def test_seeded_row_is_reproducible_anywhere_beside_anything(mine):
    mine = dict(mine, seed=7)
    alone = run([mine], 0)
    others = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.2, top_k=600, seed=3),
              dict(temperature=0.7, top_p=0.5), dict(temperature=1.0, top_p=0.99, seed=8)]
    assert run(others[:3] + [mine] + others[3:], 3, seed=1) == alone
    assert run(others[::-1] + [mine], 5, seed=2) == alone
    assert run([mine, dict(temperature=0.5)], 0, seed=3) == alone
    assert run([dict(mine, seed=70)], 0) != alone  # the draw is random, and the seed is what fixes it
    assert len(set(alone)) > 5


def test_greedy_rows_are_argmax_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    greedy = [0, 2, 5]
    want = logits[greedy].argmax(-1).tolist()
    for others in ({}, dict(temperature=1.0), dict(temperature=2.0, top_k=40, top_p=0.9)):
        gens = [gen(**(dict(temperature=0.0) if i in greedy else dict(others, seed=i))) for i in range(6)]
        got = sample(logits, gens)
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
    out = sample(logits, gens)
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
    """All -inf (a grammar mask with no way on), NaN or +inf: that sampled row
    fails as it did with softmax + multinomial; the others are drawn."""
    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    logits[1] = float("-inf")
    logits[2, 7] = float("nan")
    logits[3, 9] = float("inf")
    logits[4, :-1] = float("-inf")  # one token left: it is the draw
    out = sample(logits, [gen(temperature=1.0, top_p=p, top_k=k, logprobs=True, seed=i)
                          for i, (p, k) in enumerate([(1.0, 0), (1.0, 0), (0.9, 0), (1.0, 5), (0.5, 3), (0.9, 40)])])
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
        for i, (tok, lp) in enumerate(sample(logits, gens)):
            assert abs(lp - ref[i, tok].item()) < 1e-5
    assert sample(logits, [gen(**kw) for kw in kws])[1][1] is None


def test_benchmark_runs(capsys):
    from interlace.bench import sampler as bench

    assert bench.main(["--batches", "2", "--vocab", "2048", "--steps", "1", "--cases", "greedy", "top-p 0.9"]) == 0
    out = capsys.readouterr().out
    assert "| top-p 0.9 |" in out and "machine: " in out


def test_nucleus_edge_inside_one_histogram_bin(sampler_path):
    """Seven tokens within 0.03 nats of each other (one bin of the kernel's histogram, 1/16 nat wide)
    and the top-p edge among them: the kernel sorts that bin's tokens to cut it exactly."""
    logits = torch.tensor([1.00, 1.005, 1.01, 1.015, 1.02, 1.025, 1.03, -2.0, -3.0])
    top_p = 0.5
    p = torch.softmax(logits.double(), 0)
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += float(p[i])
    assert 3 <= len(kept) <= 5  # the edge falls inside the close group
    probs = [float(p[i]) / mass if i in kept else 0.0 for i in range(len(logits))]
    rng = torch.Generator().manual_seed(11)
    gens = [gen(rng, temperature=1.0, top_p=top_p) for _ in range(N)]
    toks = [t for t, _ in sample(logits.repeat(N, 1), gens)]
    assert_fits(toks, probs)


@pytest.mark.parametrize("vocab", [1000, 2053])  # the kernel's draw walks chunks of 512 tokens
def test_nucleus_kernel_draws_the_inverse_cdf_token(vocab):
    """The kernel's token for uniform u is the first kept token, in vocabulary order, at which the
    cumulative weight of the kept tokens passes u times their total: checked against a float64
    reference for uniforms spread over [0, 1) -- in the first, a middle and the last chunk, past
    chunks with nothing kept (the -inf run), and at u close to 1."""
    from interlace.engine_ext.native import cpu_matmul

    ops = cpu_matmul.load()
    if ops is None:
        pytest.skip("no C++ compiler: no nucleus kernel (the torch path is tested above)")
    g = torch.Generator().manual_seed(vocab)
    x = 2 * torch.randn(vocab, generator=g)
    x[600:900] = float("-inf")  # a run with nothing to draw, a whole chunk of it for the second size
    x[torch.randint(0, vocab, (12,), generator=g)] += 6
    us = torch.cat([torch.rand(200, generator=g, dtype=torch.float64), torch.tensor([0.0, 1 - 1e-12])])
    for temp, top_p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.5)):
        w = torch.exp((x.double() - x.max()) / temp)
        order = sorted(range(vocab), key=lambda i: (-float(w[i]), i))
        total, kept = float(w.sum()), torch.zeros(vocab, dtype=torch.bool)
        cum = 0.0
        for i in order:  # the fewest most likely tokens whose mass reaches top_p
            if top_p < 1 and cum >= top_p * total:
                break
            kept[i] = True
            cum += float(w[i])
        cw = torch.where(kept, w, torch.zeros_like(w)).cumsum(0)
        got = ops.sample_top_p(x.repeat(len(us), 1), torch.full((len(us),), temp), torch.full((len(us),), top_p), us)
        want = torch.searchsorted(cw, us * cw[-1], right=True).clamp(max=vocab - 1)
        close = ((cw[want] - us * cw[-1]).abs() < 1e-6 * cw[-1]) | ((cw[(want - 1).clamp(min=0)] - us * cw[-1]).abs()
                                                                     < 1e-6 * cw[-1])
        assert kept[got].all(), (temp, top_p)
        assert ((got == want) | close).all(), (temp, top_p, got[got != want], want[got != want])
