"""Decode attention on the CPU that reads the paged KV cache in place.

The torch path (``Attention._decode_attention``) gathers every decoding
context's blocks into one padded tensor per layer and runs two batched
matmuls: at batch 32 and 130-token contexts the gather and the matmuls were
a quarter of a decode step, for arithmetic that is a few hundred MFLOP.  This
kernel walks each context's block table instead: for one (context, KV head)
it loads each key once for the query heads of its GQA group, keeps an online
softmax (running max and sum) per head in float32, and accumulates the values
-- no copy of the cache, no padding to the longest context, no mask.

It is C, compiled on first use with the system's C compiler (``cc -O3
-march=native``) into the cache directory, keyed by the source, the flags and
the CPU's flags (machines differ between sessions), and called through
``ctypes``, which releases the GIL: the (context, KV head) items are split
over ``torch.get_num_threads()`` Python threads.  Without a compiler, or if
the build fails, :func:`load` returns ``None`` and the engine keeps the torch
path (one log line says why).  KV float32 or bfloat16, queries float32;
``tests/test_cpu_attention.py`` checks it against the torch path on ragged
lengths, block boundaries, forks sharing blocks, GQA and sliding windows.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from . import cbuild

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
""" + cbuild.EXP_LE0 + r"""

#define MAX_G 16
#define MAX_D 256

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

#define TILE 32  /* keys scored together: one max, one rescale of the accumulators, one vector exp */

#define KERNEL(NAME, T, LOAD)                                                                       \
int NAME(const float *q, const T *kc, const T *vc, const int64_t *bt, const int64_t *bt_start,      \
         const int64_t *lens, int64_t H, int64_t Hkv, int64_t D, int64_t num_blocks, int64_t bs,    \
         float scale, int64_t window, float *out, int64_t item_begin, int64_t item_end) {            \
    const int64_t G = H / Hkv;                                                                      \
    if (G > MAX_G || D > MAX_D) return -1;                                                          \
    float acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G], kf[MAX_D], s[MAX_G][TILE];                         \
    const T *vrow[TILE];                                                                            \
    for (int64_t item = item_begin; item < item_end; item++) {                                      \
        const int64_t b = item / Hkv, h = item % Hkv, len = lens[b];                                \
        const int64_t first = (window > 0 && len > window) ? len - window : 0;                      \
        const float *qb = q + (b * H + h * G) * D;                                                  \
        for (int64_t g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f;                             \
            memset(acc[g], 0, sizeof(float) * D); }                                                 \
        const int64_t *table = bt + bt_start[b];                                                    \
        for (int64_t t0 = first; t0 < len; t0 += TILE) {                                            \
            const int nt = (int)(len - t0 < TILE ? len - t0 : TILE);                                \
            for (int j = 0; j < nt; j++) {                                                          \
                const int64_t t = t0 + j;                                                           \
                const int64_t slot = (h * num_blocks + table[t / bs]) * bs + t % bs;                \
                const T *kp = kc + slot * D;                                                        \
                vrow[j] = vc + slot * D;                                                            \
                for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kp[d]);                                \
                for (int64_t g = 0; g < G; g++) {                                                   \
                    const float *qg = qb + g * D;                                                   \
                    float dot = 0.f;                                                                \
                    _Pragma("omp simd reduction(+:dot)")                                            \
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * kf[d];                           \
                    s[g][j] = dot * scale;                                                          \
                }                                                                                   \
            }                                                                                       \
            for (int64_t g = 0; g < G; g++) {                                                       \
                float mt = m[g];                                                                    \
                for (int j = 0; j < nt; j++) mt = s[g][j] > mt ? s[g][j] : mt;                      \
                const float c = exp_le0(m[g] - mt);                                                 \
                float sum = 0.f;                                                                    \
                _Pragma("omp simd reduction(+:sum)")                                                \
                for (int j = 0; j < nt; j++) { s[g][j] = exp_le0(s[g][j] - mt); sum += s[g][j]; }   \
                l[g] = l[g] * c + sum;                                                              \
                m[g] = mt;                                                                          \
                float *a = acc[g];                                                                  \
                _Pragma("omp simd")                                                                 \
                for (int64_t d = 0; d < D; d++) a[d] *= c;                                          \
            }                                                                                       \
            for (int j = 0; j < nt; j++) {                                                          \
                const T *vp = vrow[j];                                                              \
                for (int64_t d = 0; d < D; d++) kf[d] = LOAD(vp[d]);                                \
                for (int64_t g = 0; g < G; g++) {                                                   \
                    float *a = acc[g];                                                              \
                    const float p = s[g][j];                                                        \
                    _Pragma("omp simd")                                                             \
                    for (int64_t d = 0; d < D; d++) a[d] += p * kf[d];                              \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t g = 0; g < G; g++) {                                                           \
            float *o = out + (b * H + h * G + g) * D, inv = l[g] > 0.f ? 1.f / l[g] : 0.f;          \
            for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;                                 \
        }                                                                                           \
    }                                                                                               \
    return 0;                                                                                       \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
KERNEL(paged_decode_f32, float, LOAD_F32)
KERNEL(paged_decode_bf16, uint16_t, LOAD_BF16)
"""

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c11")

# Below this many (key x query head x head dim) products a decode step's attention runs in the calling
# thread: measured at batch 1, handing two of three KV heads to a pool thread took ~130 us per layer,
# 22% of a decode step, for ~25 us of arithmetic.
PARALLEL_MIN_WORK = 1 << 19

_lock = threading.Lock()
_loaded: dict = {}


class PagedDecodeKernel:
    """The compiled kernel and the threads that run it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.paged_decode_f32, torch.bfloat16: lib.paged_decode_bf16}
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64, ptr, i64, i64]
        self._pool: Optional[ThreadPoolExecutor] = None
        self._threads = 0

    def supports(self, kv_dtype: torch.dtype, group: int, head_dim: int) -> bool:
        return kv_dtype in self._fns and group <= 16 and head_dim <= 256

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
        """q [B, H, D] float32; k_cache/v_cache [Hkv, num_blocks, bs, D] (one layer, contiguous);
        ``tables`` every context's blocks, concatenated (int64), context ``b``'s from ``starts[b]``;
        ``lens`` [B] int64 keys per context.  Returns [B, H, D] float32."""
        B, H, D = q.shape
        hkv, nb, bs, _ = k_cache.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        fn = self._fns[k_cache.dtype]
        args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), starts.data_ptr(),
                lens.data_ptr(), H, hkv, D, nb, bs, ctypes.c_float(scale), int(window), out.data_ptr())
        items = B * hkv
        n = max(1, min(torch.get_num_threads(), items))
        if n > 1 and int(lens.sum()) * H * D < PARALLEL_MIN_WORK:
            n = 1  # waking a second thread (behind torch's spinning OpenMP workers) costs more than the work
        if n == 1:
            self._check(fn(*args, 0, items))
            return out
        if self._pool is None or self._threads != n:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._threads = ThreadPoolExecutor(n, thread_name_prefix="interlace-attn"), n
        cuts = [items * i // n for i in range(n + 1)]
        futures = [self._pool.submit(fn, *args, cuts[i], cuts[i + 1]) for i in range(1, n)]
        self._check(fn(*args, cuts[0], cuts[1]))  # this thread takes the first share
        for f in futures:
            self._check(f.result())
        return out

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError("paged decode kernel: unsupported head shape")


def load(cache_dir: Optional[Path] = None) -> Optional[PagedDecodeKernel]:
    """The kernel, built on first use (a second or two) and cached; ``None`` where it cannot be built."""
    command = [cbuild.compiler(), *FLAGS]
    target = cbuild.target("paged_decode", SOURCE, [*command[1:], "-lm"], cache_dir)
    with _lock:
        if target in _loaded:
            return _loaded[target]
        kernel = None
        try:
            if not target.exists():
                cbuild.build(SOURCE, "c", command, target, ["-lm"])
            kernel = PagedDecodeKernel(ctypes.CDLL(str(target)))
        except (OSError, cbuild.BuildError) as e:
            log.warning("the CPU paged-attention kernel is not available (%s); decode attention gathers the "
                        "cache with torch instead", e)
        _loaded[target] = kernel
        return kernel
