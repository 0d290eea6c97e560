"""Building a native engine with its configured policies.

The one place where a :class:`~interlace.engine_ext.native.engine.NativeEngine`
is built from a model path, engine arguments and a policy: the gateway's
in-process engines (``gateway/app.py`` ``load_engine``) and the engines in
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
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # the gateway's config dataclass; only its attributes are read here
    from ...gateway.config import PolicySpec
    from .engine import NativeEngine

log = logging.getLogger(__name__)


def model_dir(path: str | os.PathLike) -> Path:
    """The Hugging Face directory of a model path: ``"embedded"`` (the
    embedded SmolLM2), a model directory, or a ``.gguf`` file (converted
    once into a cached directory)."""
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
    and ranking policies and cost profile.  The profile they reason with may
    have to be measured on this engine (``auto``), so the engine is built
    first and given its policies before it serves.  Without a policy: the
    engine's defaults (preserve, first come first served)."""
    from ..policies import ObjectiveRanking, ToolDurations, make_interception, make_ranking
    from .engine import NativeEngine

    path = model_dir(path)
    if policy is None:
        return NativeEngine.load(path, **engine_args)
    p = policy
    engine = NativeEngine.load(path, **engine_args, host_pool_tokens=p.swap_space_tokens,
                               prefix_caching=p.prefix_caching)
    try:
        profile = engine_profile(engine, p.profile, p.swap_space_tokens)
        interception = make_interception(p.interception, profile, ToolDurations())
        # Parrot's objectives (latency first, task groups together) around the configured ranking
        ranking = ObjectiveRanking(make_ranking(p.ranking, profile, interception,
                                                starvation_threshold=p.starvation_threshold,
                                                refresh_interval=p.refresh_interval))
        engine.set_policies(interception=interception, ranking=ranking, profile=profile)
    except BaseException:
        engine.close()
        raise
    return engine


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
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{engine.name}-{dtype}-{device}-bs{engine.block_size}-m{METHOD}")
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
