"""The block zoo on disk: bases, full fine-tunes and LoRA variants sharing
content-addressed blocks (BlockLLM §4.3).

Layout under ``root`` (default ``$INTERLACE_ZOO``, else ``<cache>/zoo``)::

    zoo.json                      manifest (written atomically)
    blocks/<sha256>.safetensors   one file per distinct block, tensors under block-relative names
    bases/<name>/                 a base's config.json and tokenizer files (so a moved source still loads)
    adapters/<name>/              a LoRA variant's adapter_config.json + adapter_model.safetensors
    .lock                         flock'ed while the zoo is changed

A full fine-tune identical to its base in 28 of 30 layers adds only the blocks
that differ.  Every change checks all input first, writes new files under
temporary names, then renames them and rewrites the manifest; a failure
removes what it wrote, so a rejected ``add`` leaves the zoo as it was.

Loading maps block files into memory (``mmap`` with copy-on-write, so the
tensors are writable but writes never reach the file) and keeps a process-wide
weak cache keyed by block hash: two variants sharing a block get the *same*
tensor objects, and eight variants of one base hold the base's bytes once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import mmap
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .blocks import (CorruptAdapter, DuplicateVariant, ShapeMismatch, UnknownBase, UnknownVariant, ZooError,
                     block_hash, derived_hash, hf_name, is_ignored, read_json_object, sort_key, split_name)
from .lora import ADAPTER_FILES, LoraAdapter, load_peft_adapter

MANIFEST = "zoo.json"
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")
# (HF config key, ModelConfig attribute): must be equal for a variant to run on its base's engine
CONFIG_FIELDS = (("model_type", "model_type"), ("hidden_size", "hidden_size"),
                 ("intermediate_size", "intermediate_size"), ("num_hidden_layers", "num_layers"),
                 ("num_attention_heads", "num_heads"), ("num_key_value_heads", "num_kv_heads"),
                 ("head_dim", "head_dim"), ("vocab_size", "vocab_size"),
                 ("tie_word_embeddings", "tie_word_embeddings"), ("attention_bias", "attention_bias"),
                 ("rms_norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"), ("rope_scaling", "rope_scaling"),
                 ("sliding_window", "sliding_window"))
_LOSSLESS_TO_F32 = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class VariantInfo:
    """One manifest entry.  For a base, ``base`` is its own name and every block counts as unique."""

    name: str
    base: str
    kind: str  # "base" | "full" | "lora"
    source: str  # the path it was added from
    blocks: Dict[str, str]  # block id -> content hash (effective: after merges)
    unique_blocks: List[str]  # block ids whose hash differs from the base's
    unique_bytes: int  # bytes of those blocks (LoRA: the adapter tensors' bytes)
    merged: Dict[str, dict] = field(default_factory=dict)  # block id -> merge report


@dataclass
class LoadedVariant:
    name: str
    base: str
    kind: str
    base_dir: Path  # a HF directory with the base's config.json and tokenizer files
    config: dict  # the base's config.json
    tensors: Dict[str, torch.Tensor]  # full state dict, HF names, merges resolved (LoRA: the base's tensors)
    block_hashes: Dict[str, str]  # block id -> hash (LoRA-touched blocks: derived from base hash + adapter)
    lora: Optional[LoraAdapter]


def default_root() -> Path:
    env = os.environ.get("INTERLACE_ZOO")
    if env:
        return Path(env).expanduser()
    from interlace.engine_ext.native.loader import cache_root

    return cache_root() / "zoo"


# ---------------------------------------------------------------- memory-mapped blocks, shared per process

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_cache: "weakref.WeakValueDictionary[Tuple[str, str], torch.Tensor]" = weakref.WeakValueDictionary()
_cache_lock = threading.Lock()


def map_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of one copy-on-write mmap
    (nothing read until touched; pages shared with the page cache)."""
    try:
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        n = int.from_bytes(mm[:8], "little")
        header = json.loads(mm[8:8 + n])
    except (OSError, ValueError) as e:
        raise CorruptAdapter(f"{path}: unreadable block file: {e}") from e
    start0, out = 8 + n, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = _DTYPES[meta["dtype"]], meta["shape"]
        begin, end = meta["data_offsets"]
        count = (end - begin) // dtype.itemsize
        if start0 + end > len(mm):
            raise CorruptAdapter(f"{path}: tensor {name!r} lies past the end of the file")
        out[name] = (torch.frombuffer(mm, dtype=dtype, count=count, offset=start0 + begin).reshape(shape)
                     if count else torch.empty(shape, dtype=dtype))
    return out


def _block_tensors(path: Path, h: str) -> Dict[str, torch.Tensor]:
    """Block ``h``'s tensors (block-relative names): the same objects for as
    long as anyone holds them, mapped again once all are gone."""
    with _cache_lock:
        names = _names.get(h)
        if names is not None:
            got = {n: _cache.get((h, n)) for n in names}
            if all(t is not None for t in got.values()):
                return got  # type: ignore[return-value]
        tensors = map_safetensors(path)
        for n, t in tensors.items():
            cached = _cache.get((h, n))
            if cached is not None:
                tensors[n] = cached
            else:
                _cache[(h, n)] = t
        _names[h] = tuple(tensors)
        return tensors


_names: Dict[str, Tuple[str, ...]] = {}  # block hash -> its tensor names (tiny; outlives the tensors)


# ---------------------------------------------------------------- reading checkpoints


class _Checkpoint:
    """The safetensors files of a HF directory, opened for reading tensor by tensor."""

    def __init__(self, model_dir: Path, stack: contextlib.ExitStack):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ZooError(f"{model_dir}: no .safetensors weights")
        self.where: Dict[str, object] = {}
        self.meta: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {}
        for f in files:
            try:
                st = stack.enter_context(safe_open(str(f), framework="pt"))
                for k in st.keys():
                    if is_ignored(k):
                        continue
                    if k in self.where:
                        raise ZooError(f"{f}: tensor {k!r} also appears in another file")
                    sl = st.get_slice(k)
                    self.where[k] = st
                    self.meta[k] = (_DTYPES.get(sl.get_dtype(), None), tuple(sl.get_shape()))
            except (SafetensorError, OSError) as e:
                raise CorruptAdapter(f"{f}: unreadable safetensors: {e}") from e
        self.files = files

    def blocks(self) -> Dict[str, Dict[str, str]]:
        """block id -> {relative name: HF name}; unknown tensor names are an error."""
        out: Dict[str, Dict[str, str]] = {}
        for k in self.where:
            try:
                bid, rel = split_name(k)
            except ZooError as e:
                raise ZooError(f"{self.files[0].parent}: {e}") from e
            out.setdefault(bid, {})[rel] = k
        return out

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.where[name].get_tensor(name)  # type: ignore[attr-defined]
        except (SafetensorError, OSError) as e:
            raise CorruptAdapter(f"{self.files[0].parent}: tensor {name!r} unreadable: {e}") from e


def _normalized(raw: dict, where: str) -> dict:
    from interlace.engine_ext.native.models import ModelConfig, UnsupportedModel

    try:
        cfg = ModelConfig.from_hf(raw)
    except (UnsupportedModel, KeyError, TypeError) as e:
        raise ZooError(f"{where}: config.json: {e}") from e
    return {key: getattr(cfg, attr) for key, attr in CONFIG_FIELDS}


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6)
    return a == b


def _read_config(model_dir: Path) -> dict:
    return read_json_object(model_dir / "config.json", ZooError, "unreadable")


# ---------------------------------------------------------------- the zoo


class Zoo:
    """A directory of bases and variants sharing content-addressed blocks."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()

    # -------------------------------------------------- reading

    def _manifest(self) -> dict:
        f = self.root / MANIFEST
        if not f.exists():
            return {"version": 1, "variants": {}, "block_bytes": {}}
        try:
            return json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ZooError(f"{f}: unreadable zoo manifest: {e}") from e

    def variants(self) -> List[VariantInfo]:
        """Every entry, bases first, then by name."""
        vs = [VariantInfo(**v) for v in self._manifest()["variants"].values()]
        return sorted(vs, key=lambda v: (v.kind != "base", v.base, v.name))

    def info(self, name: str) -> VariantInfo:
        return self._entry(self._manifest(), name)

    def _entry(self, man: dict, name: str) -> VariantInfo:
        v = man["variants"].get(name)
        if v is None:
            known = ", ".join(sorted(man["variants"])) or "none"
            raise UnknownVariant(f"no variant {name!r} in the zoo at {self.root} (known: {known})")
        return VariantInfo(**v)

    def block_path(self, h: str) -> Path:
        return self.root / "blocks" / f"{h}.safetensors"

    def base_dir(self, base: str) -> Path:
        return self.root / "bases" / base

    def adapter_dir(self, name: str) -> Path:
        return self.root / "adapters" / name

    def load(self, name: str) -> LoadedVariant:
        """A variant's full state dict, memory-mapped and shared with every
        other loaded variant holding the same blocks."""
        man = self._manifest()
        info = self._entry(man, name)
        base = self._entry(man, info.base)
        own = base.blocks if info.kind == "lora" else info.blocks
        tensors: Dict[str, torch.Tensor] = {}
        for bid, h in sorted(own.items(), key=lambda kv: sort_key(kv[0])):
            for rel, t in _block_tensors(self.block_path(h), h).items():
                tensors[hf_name(bid, rel)] = t
        base_dir = self.base_dir(info.base)
        lora = None
        if info.kind == "lora":
            from interlace.engine_ext.native.models import ModelConfig

            lora = load_peft_adapter(self.adapter_dir(name), ModelConfig.from_hf(_read_config(base_dir)), name)
        return LoadedVariant(name=name, base=info.base, kind=info.kind, base_dir=base_dir,
                             config=_read_config(base_dir), tensors=tensors, block_hashes=dict(info.blocks),
                             lora=lora)

    # -------------------------------------------------- changing

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        """Hold the zoo's lock; yields the manifest as read under it."""
        for sub in ("blocks", "bases", "adapters"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self._manifest()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_manifest(self, man: dict) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".zoo-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(man, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.root / MANIFEST)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def add(self, name: str, path: str, base: Optional[str] = None) -> VariantInfo:
        """Register a base (``base=None``; ``path``: HF dir, .gguf or "embedded")
        or a variant of ``base`` (a full fine-tune HF dir or a PEFT LoRA dir)."""
        if not _NAME_OK.match(name or ""):
            raise ZooError(f"invalid name {name!r}: use letters, digits, '.', '_', '-' (128 at most)")
        with self._locked() as man:
            if name in man["variants"]:
                raise DuplicateVariant(f"{name!r} is already in the zoo at {self.root}")
            bases = sorted(n for n, v in man["variants"].items() if v["kind"] == "base")
            if base is not None and base not in bases:
                raise UnknownBase(f"no base {base!r} in the zoo (bases: {', '.join(bases) or 'none'})")
            written: List[Path] = []
            try:
                if base is None:
                    entry = self._add_base(man, name, path, written)
                else:
                    src = Path(path).expanduser()
                    if (src / "adapter_config.json").is_file():
                        entry = self._add_lora(man, name, src, base, written)
                    elif (src / "config.json").is_file():
                        entry = self._add_full(man, name, src, base, written)
                    else:
                        raise ZooError(f"{path}: neither a model directory (config.json) "
                                       f"nor a PEFT adapter (adapter_config.json)")
                man["variants"][name] = asdict(entry)
                self._write_manifest(man)
            except BaseException:
                for p in reversed(written):
                    if p.is_dir():
                        shutil.rmtree(p)
                    else:
                        p.unlink(missing_ok=True)
                raise
            return entry

    def _store_block(self, man: dict, tensors: Dict[str, torch.Tensor], written: List[Path]) -> Tuple[str, int]:
        """Hash a block (block-relative names) and write it unless present; -> (hash, bytes)."""
        h = block_hash(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        dest = self.block_path(h)
        if not dest.exists():
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".block-")
            os.close(fd)
            try:
                save_file({k: t.contiguous() for k, t in tensors.items()}, tmp)
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            written.append(dest)
        man["block_bytes"][h] = nbytes
        return h, nbytes

    def _copy_dir(self, files: List[Path], dest: Path, written: List[Path]) -> None:
        """Copy ``files`` into ``dest`` through a temporary directory renamed at the end."""
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
        written.append(tmp)
        for f in files:
            shutil.copy2(f, tmp / f.name)
        if dest.exists():  # left over from a crash: not in the manifest, so nobody uses it
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        written[-1] = dest

    def _add_base(self, man: dict, name: str, path: str, written: List[Path]) -> VariantInfo:
        from interlace.engine_ext.native.loader import resolve_model_dir

        if str(path) == "embedded":
            from interlace.engine_ext.embedded import embedded_model_dir

            model_dir = embedded_model_dir()
        else:
            model_dir = resolve_model_dir(path)
        _normalized(_read_config(model_dir), str(model_dir))
        blocks, sizes = {}, 0
        with contextlib.ExitStack() as stack:
            ck = _Checkpoint(model_dir, stack)
            for bid, names in sorted(ck.blocks().items(), key=lambda kv: sort_key(kv[0])):
                h, n = self._store_block(man, {rel: ck.get(k) for rel, k in names.items()}, written)
                blocks[bid] = h
                sizes += n
        extra = [f for f in sorted(model_dir.iterdir())
                 if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name != "model.safetensors.index.json"]
        self._copy_dir(extra, self.base_dir(name), written)
        return VariantInfo(name=name, base=name, kind="base", source=str(path), blocks=blocks,
                           unique_blocks=sorted(blocks, key=sort_key), unique_bytes=sizes, merged={})

    def _add_full(self, man: dict, name: str, src: Path, base: str, written: List[Path]) -> VariantInfo:
        base_info = self._entry(man, base)
        want = _normalized(_read_config(self.base_dir(base)), f"base {base}")
        got = _normalized(_read_config(src), str(src))
        for key, _ in CONFIG_FIELDS:
            if not _same(want[key], got[key]):
                raise ShapeMismatch(f"{src}/config.json: {key} is {got[key]!r}, the base {base!r} has {want[key]!r}")
        base_tensors = self.load(base).tensors
        blocks, unique, sizes = {}, [], 0
        with contextlib.ExitStack() as stack:
            ck = _Checkpoint(src, stack)
            missing = sorted(set(base_tensors) - set(ck.meta))
            extra = sorted(set(ck.meta) - set(base_tensors))
            if missing or extra:
                what = f"lacks tensor {missing[0]!r}" if missing else f"has tensor {extra[0]!r} the base lacks"
                raise ShapeMismatch(f"{src}: {what} (base {base!r})")
            for k, (dtype, shape) in ck.meta.items():
                b = base_tensors[k]
                if shape != tuple(b.shape):
                    raise ShapeMismatch(f"{src}: tensor {k!r} has shape {shape}, the base {base!r} has "
                                        f"{tuple(b.shape)}")
                if dtype != b.dtype and not (b.dtype == torch.float32 and dtype in _LOSSLESS_TO_F32):
                    raise ShapeMismatch(f"{src}: tensor {k!r} is {dtype}, the base {base!r} is {b.dtype} "
                                        f"(only lossless casts to the base's dtype are done)")
            for bid, names in sorted(ck.blocks().items(), key=lambda kv: sort_key(kv[0])):
                tensors = {rel: ck.get(k).to(base_tensors[k].dtype) for rel, k in names.items()}
                h = block_hash(tensors)
                if h != base_info.blocks.get(bid):
                    h, n = self._store_block(man, tensors, written)
                    unique.append(bid)
                    sizes += n
                blocks[bid] = h
        return VariantInfo(name=name, base=base, kind="full", source=str(src), blocks=blocks,
                           unique_blocks=unique, unique_bytes=sizes, merged={})

    def _add_lora(self, man: dict, name: str, src: Path, base: str, written: List[Path]) -> VariantInfo:
        from interlace.engine_ext.native.models import ModelConfig

        base_info = self._entry(man, base)
        adapter = load_peft_adapter(src, ModelConfig.from_hf(_read_config(self.base_dir(base))), name)
        blocks = dict(base_info.blocks)
        touched = adapter.blocks()
        for bid, tensors in touched.items():
            if bid not in blocks:
                raise ShapeMismatch(f"{src}: adapts block {bid!r}, which the base {base!r} lacks")
            blocks[bid] = derived_hash(base_info.blocks[bid], tensors)
        self._copy_dir([src / f for f in ADAPTER_FILES], self.adapter_dir(name), written)
        return VariantInfo(name=name, base=base, kind="lora", source=str(src), blocks=blocks,
                           unique_blocks=sorted(touched, key=sort_key), unique_bytes=adapter.nbytes(), merged={})

    def remove(self, name: str) -> None:
        """Forget a variant (or a base with no variants left) and delete the
        blocks nothing references any more."""
        with self._locked() as man:
            info = self._entry(man, name)
            if info.kind == "base":
                users = sorted(n for n, v in man["variants"].items() if v["base"] == name and n != name)
                if users:
                    raise ZooError(f"base {name!r} still has variants: {', '.join(users)} (remove them first)")
            del man["variants"][name]
            live = self._referenced(man)
            dead = [h for h in man["block_bytes"] if h not in live]
            for h in dead:
                del man["block_bytes"][h]
            self._write_manifest(man)  # first the manifest: a crash leaves garbage, never a dangling block
            for h in dead:
                self.block_path(h).unlink(missing_ok=True)
            if info.kind != "full":
                shutil.rmtree(self.base_dir(name) if info.kind == "base" else self.adapter_dir(name))

    @staticmethod
    def _referenced(man: dict) -> set:
        """Hashes with a block file in use: effective blocks and merged-away originals (kept for unmerge)."""
        live = set()
        for v in man["variants"].values():
            if v["kind"] == "lora":
                continue  # its hashes are derived, no file
            live.update(v["blocks"].values())
            live.update(r["original_hash"] for r in v["merged"].values())
        return live

    def apply_merge(self, name: str, reports: Mapping[str, dict]) -> VariantInfo:
        """Record that ``name`` now uses its base's blocks ``reports`` (block id
        -> merge report): called by ``equivalence.analyze(merge=True)`` only."""
        with self._locked() as man:
            info = self._entry(man, name)
            if info.kind != "full":
                raise ZooError(f"only full fine-tunes can be merged, {name!r} is {info.kind}")
            base = self._entry(man, info.base)
            for bid, report in reports.items():
                if bid not in info.unique_blocks:
                    raise ZooError(f"{name!r}: block {bid!r} is not unique to it, nothing to merge")
                info.merged[bid] = {**report, "original_hash": info.blocks[bid]}
                info.blocks[bid] = base.blocks[bid]
            self._recount(man, info, base)
            return info

    def unmerge(self, name: str, blocks: Optional[List[str]] = None) -> VariantInfo:
        """Undo merges: the variant uses its own blocks again (all, or ``blocks``)."""
        with self._locked() as man:
            info = self._entry(man, name)
            for bid in list(info.merged) if blocks is None else blocks:
                if bid not in info.merged:
                    raise ZooError(f"{name!r}: block {bid!r} is not merged")
                info.blocks[bid] = info.merged.pop(bid)["original_hash"]
            self._recount(man, info, self._entry(man, info.base))
            return info

    def _recount(self, man: dict, info: VariantInfo, base: VariantInfo) -> None:
        info.unique_blocks = sorted((b for b, h in info.blocks.items() if h != base.blocks.get(b)), key=sort_key)
        info.unique_bytes = sum(man["block_bytes"][info.blocks[b]] for b in info.unique_blocks)
        man["variants"][info.name] = asdict(info)
        self._write_manifest(man)


__all__ = ["Zoo", "VariantInfo", "LoadedVariant", "ZooError", "UnknownBase", "UnknownVariant",
           "DuplicateVariant", "ShapeMismatch", "CorruptAdapter", "default_root", "map_safetensors", "MANIFEST"]
