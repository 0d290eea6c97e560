"""Building a native engine with its configured policies.

The one place where a :class:`~interlace.engine_ext.native.engine.NativeEngine`
is built from a model path, engine arguments and a policy: the gateway's
in-process engines (``gateway/models.py`` ``load_engine``) and the engines in
worker processes (``engine_ext/worker.py``) both call
:func:`build_native_engine`, so they serve with the same policies.

Torch and the engine are imported inside the functions: importing this
module is cheap (the gateway imports it at start-up).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:  # the gateway's config dataclass; only its attributes are read here
    from ..policies import PolicySpec
    from .engine import NativeEngine

log = logging.getLogger(__name__)


ZOO_PREFIX = "zoo/"


def set_engine_threads(requested: Optional[int] = None) -> tuple[int, str]:
    """Set torch's intra-op (OpenMP) threads for the engines in this process:
    ``requested``, else one per usable core (:func:`.cores.usable_cores`:
    the affinity mask, capped by a cgroup's CPU quota).  More runnable OpenMP
    workers than free cores make every matmul wait for the slowest one (a
    decode step measured 0.78 s went to 3.8 s on a busy 2-core machine), so
    this is the *most* an engine uses: with ``adapt_threads`` (the default)
    each engine runs on as many of them as are free (:mod:`.cores`).  Returns
    the count and where it came from, for the start-up log."""
    import torch

    from .cores import usable_cores

    cores = usable_cores()
    n = int(requested) if requested else cores
    torch.set_num_threads(n)
    why = "engine.threads" if requested else f"the {cores} core(s) this process may use (affinity, cgroup quota)"
    if requested and requested > cores:
        why += f"; more than the {cores} core(s) this process may use: expect stalls"
    return torch.get_num_threads(), why


def model_dir(path: str | os.PathLike, zoo: Optional[str] = None) -> Path:
    """The Hugging Face directory of a model path: ``"embedded"`` (the
    embedded SmolLM2), a model directory, a ``.gguf`` file (converted
    once into a cached directory), or ``zoo/NAME`` (a variant in the block
    zoo ``zoo``, default ``$INTERLACE_ZOO``: its base's config and tokenizer)."""
    if str(path).startswith(ZOO_PREFIX):
        from ..zoo import Zoo

        z = Zoo(zoo)
        return z.base_dir(z.info(str(path)[len(ZOO_PREFIX):]).base)
    if str(path) == "embedded":
        from ..embedded import embedded_model_dir

        return embedded_model_dir()
    from .loader import resolve_model_dir

    return resolve_model_dir(path)


def build_native_engine(path: str | os.PathLike, engine_args: Mapping[str, Any],
                        policy: Optional["PolicySpec"] = None) -> "NativeEngine":
    """The native engine of ``path`` (see :func:`model_dir`), loaded with
    ``engine_args`` (:meth:`NativeEngine.load` keyword arguments) and, given
    a ``policy`` (the gateway's ``PolicySpec``), its configured interception
    and ranking policies, capacity regulation and cost profile.  The profile they reason with may
    have to be measured on this engine (``auto``), so the engine is built
    first and given its policies before it serves.  Without a policy: the
    engine's defaults (preserve, first come first served, no capacity cap)."""
    from ..policies import ObjectiveRanking, ToolDurations, make_interception, make_ranking

    if policy is None:
        return _load(path, engine_args)
    p = policy
    engine = _load(path, {**engine_args, "host_pool_tokens": p.swap_space_tokens,
                          "prefix_caching": p.prefix_caching})
    try:
        profile = engine_profile(engine, p.profile, p.swap_space_tokens)
        interception = make_interception(p.interception, profile, ToolDurations())
        # Parrot's objectives (latency first, task groups together) around the configured ranking
        ranking = ObjectiveRanking(make_ranking(p.ranking, profile, interception,
                                                starvation_threshold=p.starvation_threshold,
                                                refresh_interval=p.refresh_interval, horizon=p.horizon,
                                                handling_at_call=p.handling_at_call))
        engine.set_policies(interception=interception, ranking=ranking, profile=profile, capacity=p.capacity())
    except BaseException:
        engine.close()
        raise
    return engine


def _load(path: str | os.PathLike, engine_args: Mapping[str, Any]) -> "NativeEngine":
    """``NativeEngine.load`` of ``path``; with ``variants`` (zoo variant
    names) in ``engine_args``, or a ``zoo/NAME`` path, one engine serving
    those variants of one base with shared blocks (:func:`load_zoo_engine`)."""
    from .engine import NativeEngine

    args = dict(engine_args)
    variants, zoo = args.pop("variants", None), args.pop("zoo", None)
    if variants is not None or str(path).startswith(ZOO_PREFIX):
        names = list(variants) if variants else [str(path)[len(ZOO_PREFIX):]]
        return load_zoo_engine(names, zoo, **args)
    if args.get("weights") == "as-shipped":  # the GGUF file itself, not its dequantized directory
        if str(path) == "embedded":
            from ..embedded import embedded_gguf

            path = embedded_gguf()
        return NativeEngine.load(path, **args)
    return NativeEngine.load(model_dir(path), **args)


def load_zoo_engine(names: Sequence[str], zoo: Optional[str] = None, *, dtype: Optional[str] = None,
                    device: Optional[str] = None, weights: Optional[str] = None, **kw: Any) -> "NativeEngine":
    """One native engine serving the zoo variants ``names`` (all of one
    base) in shared batches: the base's weights once, each variant's unique
    blocks and adapters beside them (:mod:`.block_sharing`).  The engine's
    name is the base's; a fill names its variant.  Block sharing swaps dense
    weights per variant: ``weights`` may be float32 or bfloat16, not a
    quantized format."""
    import torch

    from ..tokenizer import Tokenizer
    from ..zoo import Zoo
    from .block_sharing import VariantSet
    from .engine import NativeEngine
    from .loader import in_passing_thread, model_from_tensors, resolve_weights

    if not names:
        raise ValueError("a zoo engine needs at least one variant")
    if weights in ("int8", "as-shipped"):
        raise ValueError(f"weights: {weights} is not supported for zoo variants (block sharing swaps dense "
                         f"weights per variant); use weights: float32 or bfloat16")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = resolve_weights(weights, dtype, dev)

    def build():
        z = Zoo(zoo)
        infos = [z.info(n) for n in names]
        bases = sorted({i.base for i in infos})
        if len(bases) != 1:
            raise ValueError(f"variants {list(names)} are of several bases ({', '.join(bases)}); one engine "
                             f"serves the variants of one base")
        base = z.load(bases[0])
        model = model_from_tensors(base.config, base.tensors, torch_dtype, dev)
        variants = VariantSet(model, base.name, base.block_hashes)
        for name in names:
            if name == base.name:
                continue
            v = z.load(name)
            variants.add(name, tensors=v.tensors if v.kind == "full" else None,
                         block_hashes=v.block_hashes if v.kind == "full" else None, lora=v.lora, kind=v.kind)
        return model, Tokenizer.from_model_dir(base.base_dir, base.config), variants, base.name

    model, tok, variants, name = in_passing_thread(build)
    kw.setdefault("name", name)
    return NativeEngine(model, tok, variants=variants, **kw)


def engine_profile(engine: Any, name: str, host_pool_tokens: int = 0) -> Any:
    """The cost model for ``engine``: a profile file or built-in name, or
    (``auto``) one measured on this model, dtype and device, cached under
    ``$INTERLACE_CACHE/profiles`` so only the first start-up pays for it."""
    from ..policies import Profile, ProfileError
    from .loader import cache_root

    if name != "auto":
        return Profile.load(name)
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    device = engine.device.type
    if device == "cuda":
        import torch

        device = torch.cuda.get_device_name(engine.device)
    from .profiler import METHOD, measure_profile

    # METHOD changes when the measurement does: a profile cached by an older method is measured again
    # quantized weights (``weights: int8 / as-shipped``) run at their own speed: their own profile
    weights = getattr(engine.model, "weights_format", None)
    wtag = f"-w{weights}" if weights else ""
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_",
                 f"{engine.name}-{dtype}{wtag}-{device}-bs{engine.block_size}-m{METHOD}")
    path = cache_root() / "profiles" / f"{key}.json"
    profile = None
    if path.is_file():
        try:
            profile = Profile.load(path)
        except ProfileError as e:  # our own cache: measure again
            log.warning("ignoring the cached profile %s: %s", path, e)
    if profile is None:
        log.warning("measuring a profile of %s (once; cached in %s)", key, path)
        profile = measure_profile(engine, quick=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        profile.save(tmp)
        os.replace(tmp, path)  # atomic: a concurrent start-up never reads half a file
    # the forward and swap times are the model's and device's; the capacities are this engine's
    return dataclasses.replace(profile, kv_capacity_tokens=engine.blocks.num_blocks * engine.block_size,
                               max_batched_tokens=engine.scheduler.max_batched_tokens,
                               host_capacity_tokens=host_pool_tokens)
