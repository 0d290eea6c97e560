"""Block sharing across fine-tuned variants of one base model (BlockLLM).

One native engine serves several variants of one base: full fine-tunes
whose blocks (a layer's attention, its MLP, its norms, the embedding, the
head; ``engine_ext/zoo/blocks.py``) partly differ from the base's, and LoRA
adapters.  A block identical in content to the base's (the zoo's content
hash) is the base's tensor itself, held once; only a variant's unique
blocks take memory.

A forward pass mixes rows of any variants.  For each weight module the rows
are grouped by the tensor they use, so a block shared by every variant in
the batch runs as one matmul over all rows (BlockLLM's larger batches for
shared blocks), and a unique block runs over its own variant's rows only.
LoRA is applied per request after the base projection, as in Punica / S-LoRA
(SGMV): each adapter's rows, gathered, through ``x @ A^T @ B^T``.  The q/k/v
(and gate/up) projections are fused in the engine, so an adapter's q/k/v
A matrices are stacked (one matmul for the shared input) and each B writes
its own output columns; the scaling is folded into B.  An adapter takes
exactly its own bytes (no zero padding to a block-diagonal B).

KV computed under one variant's weights is not another's.  Each variant has
a prefix-cache namespace (the root of its block-hash chain): the digest of
every block its KV depends on (the embedding, each layer's input norm and
attention, and every layer's MLP but the last's).  Variants that differ only
past that (the head, the final norm, the last MLP) share the base's cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnknownVariant
from ..zoo.lora import projection_shape
from .models.llama import LlamaForCausalLM, RMSNorm

Weights = Tuple[torch.Tensor, Optional[torch.Tensor]]  # (weight, bias or None)
Rows = Union[None, slice, torch.Tensor]  # every row, a contiguous run of rows, or row indices


@dataclass(eq=False)
class LoraModule:
    """An adapter on one fused module: ``A`` the stacked A matrices
    [sum r, in]; per adapted projection, its output columns, its rank slice
    of ``x @ A^T`` and its B (scaling folded in)."""

    A: torch.Tensor
    parts: List[Tuple[int, int, int, int, torch.Tensor]]  # out_start, out_end, r_start, r_end, B [out, r]

    def apply(self, out: torch.Tensor, x: torch.Tensor, rows: "Rows") -> None:
        """``out[rows] += x[rows] @ A^T @ B^T`` per part, in place."""
        if rows is None:
            rows = slice(None)
        xa = x[rows] @ self.A.t()
        for o0, o1, r0, r1, B in self.parts:
            if isinstance(rows, slice):  # the runner keeps a variant's rows together: a view, no scatter
                out[rows, o0:o1].addmm_(xa[:, r0:r1], B.t())
            else:
                out[:, o0:o1].index_add_(0, rows, xa[:, r0:r1] @ B.t())


@dataclass(eq=False)
class Variant:
    name: str
    index: int
    kind: str                                                   # base | full | lora
    weights: Dict[nn.Module, Weights] = field(default_factory=dict)           # modules it overrides
    lora: Dict[nn.Module, "LoraModule"] = field(default_factory=dict)
    namespace: Optional[bytes] = None                           # prefix-cache root; None: the base's
    unique_blocks: List[str] = field(default_factory=list)


def _block_modules(model: LlamaForCausalLM) -> Dict[str, List[Tuple[nn.Module, Tuple[str, ...]]]]:
    """Each zoo block id -> the engine modules it fills, with the HF tensor
    names (fused in this order) of each module's weight."""
    from ..zoo.blocks import block_id

    out: Dict[str, List[Tuple[nn.Module, Tuple[str, ...]]]] = {}
    for mod, names in model.hf_weight_map():
        out.setdefault(block_id(names[0]), []).append((mod, names))
    if model.cfg.tie_word_embeddings:  # the head is the embedding's tensor
        out["embed"].append((model.lm_head, ("model.embed_tokens.weight",)))
    return out


def kv_blocks(num_layers: int) -> List[str]:
    """The blocks a context's KV depends on: everything before the last
    layer's attention output, in order."""
    out = ["embed"]
    for i in range(num_layers):
        out += [f"layers.{i}.input_norm", f"layers.{i}.attn"]
        if i < num_layers - 1:
            out += [f"layers.{i}.post_norm", f"layers.{i}.mlp"]
    return out


class VariantSet:
    """The variants one engine serves: the base model (index 0) and others
    registered with :meth:`add`.  Built before the engine starts; read-only
    while it serves."""

    def __init__(self, model: LlamaForCausalLM, base_name: str = "base",
                 base_hashes: Optional[Mapping[str, str]] = None):
        self.model = model
        self.cfg = model.cfg
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.modules = _block_modules(model)
        self.base_hashes = dict(base_hashes or {})
        self.variants: List[Variant] = [Variant(base_name, 0, "base")]
        self.by_name: Dict[str, Variant] = {base_name: self.variants[0]}
        self._built: Dict[str, List[Weights]] = {}  # block hash -> its fused tensors (shared by variants)

    @property
    def base(self) -> Variant:
        return self.variants[0]

    def __len__(self) -> int:
        return len(self.variants)

    def names(self) -> List[str]:
        return [v.name for v in self.variants]

    def get(self, name: Optional[str]) -> Variant:
        if name is None:
            return self.base
        v = self.by_name.get(name)
        if v is None:
            raise UnknownVariant(f"no model variant {name!r} here (variants: {', '.join(self.by_name)})")
        return v

    # ------------------------------------------------------------ building
    def add(self, name: str, *, tensors: Optional[Mapping[str, torch.Tensor]] = None,
            block_hashes: Optional[Mapping[str, str]] = None, lora: Optional[object] = None,
            kind: Optional[str] = None) -> Variant:
        """Register a variant: ``tensors`` (HF names) with their zoo
        ``block_hashes`` for a full fine-tune (a block whose hash equals the
        base's is the base's tensor, not loaded again; without hashes every
        block is compared by content), and/or ``lora`` (a
        :class:`~interlace.engine_ext.zoo.lora.LoraAdapter`)."""
        if name in self.by_name:
            raise ValueError(f"variant {name!r} is registered twice")
        v = Variant(name, len(self.variants), kind or ("lora" if lora is not None and tensors is None else "full"))
        hashes = dict(block_hashes or {})
        if tensors is not None:
            if not hashes:
                from ..zoo.blocks import block_hash, partition

                hashes = {b: block_hash(t) for b, t in partition(tensors).items()}
            for block, mods in self.modules.items():
                h = hashes.get(block)
                if h is None:
                    raise ValueError(f"variant {name!r} has no block {block!r}")
                if h == self.base_hashes.get(block) or (not self.base_hashes and self._same_as_base(mods, tensors)):
                    continue
                v.unique_blocks.append(block)
                built = self._built.get(h)
                if built is None:
                    built = self._built[h] = [self._fuse(mod, names, tensors) for mod, names in mods]
                for (mod, _), w in zip(mods, built):
                    v.weights[mod] = w
        if lora is not None:
            self._add_lora(v, lora)
        v.namespace = self._namespace(v, hashes)
        self.variants.append(v)
        self.by_name[name] = v
        return v

    def _same_as_base(self, mods, tensors) -> bool:
        return all(torch.equal(self._fuse(mod, names, tensors)[0], mod.weight) for mod, names in mods)

    def _fuse(self, mod: nn.Module, names: Sequence[str], tensors: Mapping[str, torch.Tensor]) -> Weights:
        w = torch.cat([tensors[n] for n in names]) if len(names) > 1 else tensors[names[0]]
        w = w.to(self.device, self.dtype)
        if tuple(w.shape) != tuple(mod.weight.shape):
            raise ValueError(f"{names[0]}: shape {tuple(w.shape)} differs from the base's {tuple(mod.weight.shape)}")
        bias = None
        if getattr(mod, "bias", None) is not None:
            bias = torch.cat([tensors[n.replace(".weight", ".bias")] for n in names]).to(self.device, self.dtype)
        return w, bias

    def _add_lora(self, v: Variant, lora) -> None:
        """Fuse the adapter's per-projection A/B into the engine's fused modules."""
        for i, layer in enumerate(self.model.layers):
            a = f"model.layers.{i}.self_attn."
            m = f"model.layers.{i}.mlp."
            for mod, parts in ((layer.attn.qkv, [a + "q_proj", a + "k_proj", a + "v_proj"]),
                               (layer.attn.o, [a + "o_proj"]),
                               (layer.mlp.gate_up, [m + "gate_proj", m + "up_proj"]),
                               (layer.mlp.down, [m + "down_proj"])):
                outs = [projection_shape(self.cfg, n.rsplit(".", 1)[1])[0] for n in parts]
                pieces = [(lora.weights.get(n), size) for n, size in zip(parts, outs)]
                if all(p is None for p, _ in pieces):
                    continue
                As, parts = [], []
                o = r0 = 0
                for ab, size in pieces:
                    if ab is not None:
                        A, B = ab
                        r = A.shape[0]
                        As.append(A.to(self.device, self.dtype))
                        parts.append((o, o + size, r0, r0 + r, (B.float() * lora.scaling).to(self.device, self.dtype)))
                        r0 += r
                    o += size
                v.lora[mod] = LoraModule(As[0] if len(As) == 1 else torch.cat(As), parts)
                blk = f"layers.{i}." + ("attn" if mod in (layer.attn.qkv, layer.attn.o) else "mlp")
                if blk not in v.unique_blocks:
                    v.unique_blocks.append(blk)

    def _namespace(self, v: Variant, hashes: Mapping[str, str]) -> Optional[bytes]:
        """The root of ``v``'s prefix-cache chain: None (the base's) unless a
        block its KV depends on differs; then a digest of those blocks'
        content hashes (an adapter's blocks: by the variant, whose name is
        unique in the engine)."""
        kv = kv_blocks(self.cfg.num_layers)
        if not any(b in v.unique_blocks for b in kv):
            return None
        h = hashlib.sha256(b"interlace-variant-kv\0")
        for b in kv:
            if b in v.unique_blocks:
                lora = any(m in v.lora for m, _ in self.modules[b])
                h.update(f"{b}={'lora:' + v.name if lora else hashes.get(b, v.name)}\0".encode())
        return h.digest()

    # ------------------------------------------------------------ accounting
    def weight_bytes(self) -> Dict[str, int]:
        """Bytes of weights held: ``base`` (the model's parameters), ``unique``
        (the variants' own blocks and adapters, each stored tensor once) and
        ``total``."""
        seen = set()

        def size(ts) -> int:
            n = 0
            for t in ts:
                if t is None:
                    continue
                key = (t.untyped_storage().data_ptr(), t.storage_offset())
                if key in seen:
                    continue
                seen.add(key)
                n += t.numel() * t.element_size()
            return n

        base = size(self.model.parameters())
        unique = 0
        for v in self.variants[1:]:
            unique += size([t for w in v.weights.values() for t in w])
            unique += size([t for m in v.lora.values() for t in (m.A, *(p[4] for p in m.parts))])
        return {"base": base, "unique": unique, "total": base + unique}

    def batch(self, row_variants: Sequence[int]) -> Optional["VariantBatch"]:
        """The per-step view for a flat batch, or None when every row is the
        base's (the model's plain path)."""
        if not any(row_variants):
            return None
        return VariantBatch(self, row_variants)


class VariantBatch:
    """One forward pass's rows grouped by the weights they use."""

    def __init__(self, vs: VariantSet, row_variants: Sequence[int]):
        self.vs = vs
        self.row_variants = list(row_variants)
        present: Dict[int, List[int]] = {}
        for r, v in enumerate(self.row_variants):
            present.setdefault(v, []).append(r)
        self.present = [vs.variants[v] for v in present]
        # a variant's rows as a slice when they are contiguous (the model runner orders rows by variant)
        self.rows: Dict[int, Union[slice, torch.Tensor]] = {
            v: slice(rs[0], rs[-1] + 1) if rs[-1] - rs[0] + 1 == len(rs)
            else torch.tensor(rs, dtype=torch.long, device=vs.device) for v, rs in present.items()}
        self.n = len(self.row_variants)
        self._groups: Dict[nn.Module, List[Tuple[Weights, Rows]]] = {}

    def select(self, rows: torch.Tensor) -> "VariantBatch":
        return VariantBatch(self.vs, [self.row_variants[r] for r in rows.tolist()])

    def _rows_of(self, vs: List[Variant]) -> Rows:
        if len(vs) == len(self.present):
            return None  # every row
        if len(vs) == 1:
            return self.rows[vs[0].index]
        return torch.cat([self._index(self.rows[v.index]) for v in vs])

    def _index(self, rows: Union[slice, torch.Tensor]) -> torch.Tensor:
        if isinstance(rows, slice):
            return torch.arange(rows.start, rows.stop, device=self.vs.device)
        return rows

    def groups(self, mod: nn.Module) -> List[Tuple[Weights, Rows]]:
        """(weights, rows using them; None = all rows) for ``mod``: the
        variants present grouped by tensor identity, so a shared block is one
        group however many variants share it."""
        g = self._groups.get(mod)
        if g is None:
            by_tensor: Dict[int, Tuple[Weights, List[Variant]]] = {}
            for v in self.present:
                w = v.weights.get(mod) or (mod.weight, getattr(mod, "bias", None))
                by_tensor.setdefault(id(w[0]), (w, []))[1].append(v)
            g = self._groups[mod] = [(w, self._rows_of(vs)) for w, vs in by_tensor.values()]
        return g

    def linear(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        groups = self.groups(mod)
        if len(groups) == 1:
            (w, b), _ = groups[0]
            out = F.linear(x, w, b)
        else:
            out = x.new_empty(x.shape[0], mod.weight.shape[0])
            for (w, b), rows in groups:
                out[rows] = F.linear(x[rows], w, b)
        for v in self.present:  # LoRA, per adapter over its rows (SGMV)
            m = v.lora.get(mod)
            if m is not None:
                m.apply(out, x, self._rows_of([v]))
        return out

    def norm(self, mod: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        groups = self.groups(mod)
        normed = mod.normed(x)
        if len(groups) == 1:
            return groups[0][0][0] * normed
        out = torch.empty_like(normed)
        for (w, _), rows in groups:
            out[rows] = w * normed[rows]
        return out

    def embed(self, mod: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        groups = self.groups(mod)
        if len(groups) == 1:
            return F.embedding(ids, groups[0][0][0])
        out = torch.empty(ids.shape[0], mod.weight.shape[1], dtype=mod.weight.dtype, device=mod.weight.device)
        for (w, _), rows in groups:
            out[rows] = F.embedding(ids[rows], w)
        return out
