"""Triton kernels for the native engine's CUDA path.

What lives here (each launcher is a plain function taking torch tensors):

* :mod:`.paged_attention` -- ``store_kv`` (write new rows' K/V into the paged
  cache), ``paged_decode_attention`` (one query row per context over its block
  table, GQA groups batched, optional split-K with an LSE merge) and
  ``merge_attention`` (combine two partial attentions by log-sum-exp);
* :mod:`.prefill_attention` -- ``paged_prefill_attention`` (causal chunked
  prefill whose keys are read from the paged cache, so a cached prefix and a
  new chunk are one loop);
* :mod:`.cascade` -- ``cascade_decode_attention`` (rows sharing a prefix read
  its K/V once per group) and ``find_shared_prefixes`` (finds such groups in
  the batch's block tables);
* :mod:`.reference` -- plain-PyTorch versions of each, for the tests.

Triton is needed only for these modules.  The CPU path (the torch attention in
``attention.py`` or the C++ kernel in ``cpu_attention.py``) never imports
this package, so the engine runs without Triton installed; :func:`available`
says whether the kernels can be used.

Interpreter: on a machine without CUDA the same kernels run under Triton's
interpreter (``TRITON_INTERPRET=1``, kernels execute as NumPy on CPU
tensors).  That is how the test suite checks them on CPU-only machines; it is
far too slow to serve with.  Triton (3.6 -- the GPU image's -- through 3.9)
reads the flag from the environment each time ``triton.knobs.runtime.interpret``
is consulted, and ``@triton.jit``
consults it when a function is *decorated* (it then returns an
``InterpretedFunction`` instead of a ``JITFunction``), not when it is
launched.  So the flag must be in ``os.environ`` before the kernel modules
are executed -- it does not matter whether ``triton`` itself was imported
earlier -- for *our* kernels.  Setting it here, in the package
``__init__``, guarantees that: Python always runs a package's ``__init__``
before any of its submodules.  Triton's own library functions are a catch:
``tl.max``, ``tl.sum``, ``tl.zeros``, ``tl.cdiv`` ... are themselves
``@jit`` functions in ``triton.language.standard``, decorated when ``triton``
is first imported; if that happened before the flag was set (a test that
imports ``triton`` first), they are compiled-mode ``JITFunction`` objects, which
refuse to be called inside an interpreted kernel.  :func:`_interpret_triton_language`
then rebuilds them as the interpreter would have -- only on machines without
CUDA, where compiled-mode Triton cannot run anyway.  An explicit
``TRITON_INTERPRET`` in the environment is left alone, and on a machine with
CUDA nothing is touched, so the kernels compile natively.

Versions: the kernels use only Triton APIs that 3.6 has, and the ``test``
extra pins ``triton==3.6.*`` so the CPU suite rehearses the GPU image's
release.  Triton 3.6's interpreter needs NumPy < 2.4 (it ``int()``-s a
one-element array, a TypeError since NumPy 2.4; 3.7 fixed it), hence the
extra's ``numpy<2.4``; compiled on a GPU, NumPy's version does not matter.
"""

from __future__ import annotations

import importlib.util
import os


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency of the engine
        return False
    return torch.cuda.is_available()


def _interpret_triton_language() -> None:
    """Make ``triton.language``'s own ``@jit`` helpers interpreted if triton was imported without the flag.

    Replaces each compiled-mode ``JITFunction`` in the ``triton.language``
    modules (and the ``tl.tensor`` methods built from them) by an
    ``InterpretedFunction`` of the same Python function, keeping identities
    consistent across modules: the interpreter recognises ``tl.max``'s and
    ``tl.sum``'s combine functions by identity to run them as one NumPy call.
    """
    import sys

    if "triton" not in sys.modules:
        return      # imported later, with the flag already set
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    import triton.language as tl

    swapped: dict[int, InterpretedFunction] = {}
    namespaces = [vars(m) for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m]
    for ns, owner in [(d, None) for d in namespaces] + [(dict(vars(tl.tensor)), tl.tensor)]:
        for name, obj in list(ns.items()):
            if isinstance(obj, JITFunction):
                new = swapped.setdefault(id(obj), InterpretedFunction(obj.fn))
                if owner is None:
                    ns[name] = new
                else:
                    setattr(owner, name, new)


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] not in ("", "0"):
        _interpret_triton_language()


def available() -> bool:
    """Whether Triton is importable (the kernels need nothing else)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (no CUDA here); needs Triton."""
    import triton

    return bool(triton.knobs.runtime.interpret)
