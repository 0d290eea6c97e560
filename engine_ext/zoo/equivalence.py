"""Block equivalence (BlockLLM §4.1): may a fine-tune use its base's block?

For each block unique to a variant, the base's block is swapped into the
variant and the output vocabulary distributions are compared with the
unswapped variant's on probe prompts: the cosine similarity of the softmax of
the last position's logits (the next token) and its mean over all positions.
A block *passes* when the minimum over probes of both is at least the
threshold.

Nothing is merged unless asked (``merge=True``): BlockLLM §4.2 shows that
sharing blocks can cost accuracy even at high output similarity, so passing
blocks are first swapped in *together* and the merged variant is measured on
held-out prompts (mean cosine similarity, greedy next-token agreement).  Only
when that stays at or above the threshold are the merges recorded in the
manifest, each with its report; otherwise nothing is recorded and the
reports say why.  LoRA variants are reported (how much each adapted block
matters) but never merged: their blocks are the base's plus an adapter, which
the runtime already shares.

Prompts: 16 built-in probe and 8 held-out English prompts, tokenized with the
base's tokenizer.  A base without tokenizer files (the tiny random test
models) gets seeded random token-id sequences instead (seed 0 for probes, 1
for held-out, 8-24 tokens each); caller-given prompts for such a base must be
whitespace-separated token ids.

The forward passes use transformers (offline analysis only, not serving).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from .blocks import ZooError, partition, sort_key
from .lora import merge_into
from .store import LoadedVariant, Zoo

PROMPTS = [
    "The capital of France is", "Once upon a time, there was a", "To make a cup of tea, you",
    "The best way to learn programming is", "My favourite animal is the", "Water boils at",
    "In the morning I usually", "The three primary colors are", "Photosynthesis is the process by which",
    "A good friend is someone who", "The largest planet in our solar system is", "def fibonacci(n):",
    "Dear hiring manager, I am writing to", "The main causes of the First World War were",
    "Here is a simple recipe for pancakes:", "If it rains tomorrow, we should",
    # held out
    "The stock market fell sharply because", "Translate to French: Good morning, how are you?",
    "The most important thing about exercise is", "A haiku about autumn:", "The theory of relativity states that",
    "My weekend plans include", "The difference between a virus and a bacterium is", "Step 1: open the terminal and",
]
N_PROBES = 16


@dataclass
class BlockReport:
    variant: str
    block: str
    kind: str  # the variant's kind: "full" | "lora"
    sim_min: float  # next-token cosine similarity, min over probes
    sim_mean: float  # ... mean over probes
    sim_all_min: float  # cosine averaged over all positions, min over probes
    sim_all_mean: float
    passes: bool  # min(sim_min, sim_all_min) >= threshold
    merged: bool = False  # recorded as merged by this call
    note: str = ""
    heldout: Dict[str, float] = field(default_factory=dict)  # the merged variant vs the original, when measured


def _tokenize(base_dir: Path, prompts: Sequence[str], vocab: int) -> List[List[int]]:
    if _has_tokenizer(base_dir):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base_dir)
        out = [tok(p)["input_ids"] for p in prompts]
    else:
        try:
            out = [[int(t) for t in p.split()] for p in prompts]
        except ValueError as e:
            raise ZooError(f"the base at {base_dir} has no tokenizer: prompts must be token ids "
                           f"separated by spaces ({e})") from e
        if any(not 0 <= t < vocab for ids in out for t in ids):
            raise ZooError(f"prompt token ids must lie in [0, {vocab})")
    if any(not ids for ids in out):
        raise ZooError("empty prompt")
    return out


def _has_tokenizer(base_dir: Path) -> bool:
    return (base_dir / "tokenizer.json").exists() or (base_dir / "tokenizer_config.json").exists()


def _random_prompts(n: int, vocab: int, seed: int) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 25, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n_tok,), generator=gen).tolist() for n_tok in lengths]


def prompt_ids(base_dir: Path, config: dict, probes: Optional[Sequence[str]],
               heldout: Optional[Sequence[str]]) -> tuple[List[List[int]], List[List[int]]]:
    """(probe ids, held-out ids) for a base: the caller's prompts or the defaults."""
    vocab = int(config["vocab_size"])
    if _has_tokenizer(base_dir):
        return (_tokenize(base_dir, probes or PROMPTS[:N_PROBES], vocab),
                _tokenize(base_dir, heldout or PROMPTS[N_PROBES:], vocab))
    p = _tokenize(base_dir, probes, vocab) if probes else _random_prompts(N_PROBES, vocab, seed=0)
    h = _tokenize(base_dir, heldout, vocab) if heldout else _random_prompts(len(PROMPTS) - N_PROBES, vocab, seed=1)
    return p, h


class _Runner:
    """One transformers model per base; state dicts are loaded into it in place."""

    def __init__(self, lv: LoadedVariant):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(lv.base_dir)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

    def load(self, tensors: Mapping[str, torch.Tensor], full: bool = False) -> None:
        """Copy ``tensors`` into the model: a whole state dict (``full``) or one block's."""
        res = self.model.load_state_dict(dict(tensors), strict=False)
        if res.unexpected_keys:
            raise ZooError(f"tensors the model does not have: {res.unexpected_keys[:3]}")
        missing = set(res.missing_keys) - ({"lm_head.weight"} if self.tied else set())
        if full and missing:
            raise ZooError(f"tensors missing for the model: {sorted(missing)[:3]}")

    @torch.no_grad()
    def probs(self, prompts: List[List[int]]) -> List[torch.Tensor]:
        """Per prompt: [T, V] next-token probabilities at every position."""
        return [torch.softmax(self.model(torch.tensor([ids])).logits[0].float(), -1) for ids in prompts]


def _compare(ref: List[torch.Tensor], got: List[torch.Tensor]) -> Dict[str, float]:
    cos = torch.nn.functional.cosine_similarity
    last = torch.stack([cos(a[-1], b[-1], dim=0) for a, b in zip(ref, got)])
    allpos = torch.stack([cos(a, b, dim=-1).mean() for a, b in zip(ref, got)])
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean()
    return {"sim_min": last.min().item(), "sim_mean": last.mean().item(), "sim_all_min": allpos.min().item(),
            "sim_all_mean": allpos.mean().item(), "greedy_agreement": agree.item()}


def analyze(zoo: Zoo, variant: str | None = None, threshold: float = 0.999, probes: list[str] | None = None,
            heldout: list[str] | None = None, merge: bool = False) -> List[BlockReport]:
    """Report, per unique block of ``variant`` (or of every variant), how close
    the variant stays when the base's block replaces its own; with ``merge``,
    record the passing blocks of full fine-tunes as merged if the held-out
    check agrees (see the module docstring)."""
    if not 0.0 < threshold <= 1.0:
        raise ZooError(f"threshold must be in (0, 1], got {threshold}")
    names = [variant] if variant else [v.name for v in zoo.variants() if v.kind != "base"]
    reports: List[BlockReport] = []
    runners: Dict[str, _Runner] = {}
    for name in names:
        info = zoo.info(name)
        if info.kind == "base":
            raise ZooError(f"{name!r} is a base: nothing to compare it with")
        lv, base = zoo.load(name), zoo.load(info.base)
        runner = runners.get(info.base) or runners.setdefault(info.base, _Runner(base))
        own = merge_into(lv.tensors, lv.lora) if lv.lora is not None else lv.tensors
        base_blocks, own_blocks = partition(base.tensors), partition(own)
        p_ids, h_ids = prompt_ids(lv.base_dir, lv.config, probes, heldout)
        runner.load(own, full=True)
        ref = runner.probs(p_ids)
        mine: List[BlockReport] = []
        for bid in sorted(info.unique_blocks, key=sort_key):
            runner.load(base_blocks[bid])
            s = _compare(ref, runner.probs(p_ids))
            runner.load(own_blocks[bid])
            ok = min(s["sim_min"], s["sim_all_min"]) >= threshold
            mine.append(BlockReport(variant=name, block=bid, kind=info.kind, sim_min=s["sim_min"],
                                    sim_mean=s["sim_mean"], sim_all_min=s["sim_all_min"],
                                    sim_all_mean=s["sim_all_mean"], passes=ok,
                                    note="LoRA: never merged" if info.kind == "lora" else ""))
        if merge and info.kind == "full":
            _merge(zoo, runner, own, base_blocks, mine, h_ids, threshold, len(p_ids))
        reports.extend(mine)
    return reports


def _merge(zoo: Zoo, runner: _Runner, own: Mapping[str, torch.Tensor], base_blocks: Mapping[str, Mapping],
           mine: List[BlockReport], h_ids: List[List[int]], threshold: float, n_probes: int) -> None:
    """Swap all passing blocks in at once, check on held-out prompts, record or refuse."""
    passing = [r for r in mine if r.passes]
    if not passing:
        return
    runner.load(own, full=True)
    ref = runner.probs(h_ids)
    merged = dict(own)
    for r in passing:
        merged.update(base_blocks[r.block])
    runner.load(merged, full=True)
    h = _compare(ref, runner.probs(h_ids))
    runner.load(own, full=True)
    held = {"cos_mean": h["sim_mean"], "cos_min": h["sim_min"], "cos_all_mean": h["sim_all_mean"],
            "greedy_agreement": h["greedy_agreement"], "prompts": len(h_ids)}
    for r in passing:
        r.heldout = held
    if min(h["sim_mean"], h["sim_all_mean"]) < threshold:
        for r in passing:
            r.note = (f"not merged: held-out similarity {min(h['sim_mean'], h['sim_all_mean']):.6f} "
                      f"< threshold {threshold} with {len(passing)} blocks merged together")
        return
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    zoo.apply_merge(passing[0].variant, {
        r.block: {"threshold": threshold, "sim_min": r.sim_min, "sim_mean": r.sim_mean, "sim_all_min": r.sim_all_min,
                  "sim_all_mean": r.sim_all_mean, "probes": n_probes, "heldout": held,
                  "merged_with": [q.block for q in passing], "time": stamp}
        for r in passing})
    for r in passing:
        r.merged, r.note = True, "merged"


__all__ = ["analyze", "BlockReport", "PROMPTS", "N_PROBES", "prompt_ids"]
