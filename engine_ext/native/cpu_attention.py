"""Decode attention on the CPU that reads the paged KV cache in place.

The torch path (:class:`.attention.TorchAttention`) gathers every decoding
context's blocks into one padded tensor per layer and runs two batched
matmuls: at batch 32 and 130-token contexts the gather and the matmuls were
a quarter of a decode step, for arithmetic that is a few hundred MFLOP.  This
kernel walks each context's block table instead: for one (context, KV head)
it loads each key once for the query heads of its GQA group, keeps an online
softmax (running max and sum) per head in float32, and accumulates the values
-- no copy of the cache, no padding to the longest context, no mask.

It is C++ against torch's headers, compiled on first use with
``-march=native`` (:mod:`.cbuild`, cached per source, flags, CPU and torch
version; machines differ between sessions) and registered as
``torch.ops.interlace_attn``.  The (context, KV head) items are split with
``at::parallel_for`` over torch's own OpenMP threads.  (A first version was
C called through ``ctypes`` on a Python thread pool: torch's OpenMP workers,
spinning after each op, took the pool threads' cores, and at batch 32 two
threads ran attention no faster than one -- 41 against 42 ms of a step --
while slowing the matmuls around them.)  A head dim of 64 or 128 is a
compile-time constant, so its loops unroll and vectorize fully.  Without a
compiler, or if the build fails, :func:`load` returns ``None`` and the engine
keeps the torch path (one log line says why).  KV float32 or bfloat16, queries float32;
``tests/test_cpu_attention.py`` checks it against the torch path on ragged
lengths, block boundaries, forks sharing blocks, GQA and sliding windows.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Optional

import torch

from . import cbuild

log = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <cstring>
""" + cbuild.EXP_LE0 + r"""

constexpr int MAX_G = 16, MAX_D = 256;
constexpr int TILE = 32;  // keys scored together: one max, one rescale of the accumulators, one vector exp

template <typename T> static inline float load_kv(T x);
template <> inline float load_kv<float>(float x) { return x; }
template <> inline float load_kv<uint16_t>(uint16_t x) {  // bfloat16
  const uint32_t u = (uint32_t)x << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Items [begin, end) of (context, KV head): the GQA group's query heads against the context's keys.
// DC: the head dim when known at compile time (64, 128: the loops over it unroll and vectorize fully),
// 0 for any other.
template <typename T, int DC>
static void decode_items(const float* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* bt_start,
                         const int64_t* lens, int64_t H, int64_t Hkv, int64_t Drt, int64_t num_blocks, int64_t bs,
                         float scale, int64_t window, float* out, int64_t begin, int64_t end) {
  const int64_t D = DC ? DC : Drt, G = H / Hkv;
  alignas(64) float acc[MAX_G][MAX_D], kf[MAX_D];
  float m[MAX_G], l[MAX_G], s[MAX_G][TILE];
  const T* vrow[TILE];
  for (int64_t item = begin; item < end; item++) {
    const int64_t b = item / Hkv, h = item % Hkv, len = lens[b];
    const int64_t first = (window > 0 && len > window) ? len - window : 0;
    const float* qb = q + (b * H + h * G) * D;
    for (int64_t g = 0; g < G; g++) {
      m[g] = -INFINITY;
      l[g] = 0.f;
      std::memset(acc[g], 0, sizeof(float) * D);
    }
    const int64_t* table = bt + bt_start[b];
    for (int64_t t0 = first; t0 < len; t0 += TILE) {
      const int nt = (int)(len - t0 < TILE ? len - t0 : TILE);
      for (int j = 0; j < nt; j++) {
        const int64_t t = t0 + j;
        const int64_t slot = (h * num_blocks + table[t / bs]) * bs + t % bs;
        const T* kp = kc + slot * D;
        vrow[j] = vc + slot * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) kf[d] = load_kv<T>(kp[d]);
        for (int64_t g = 0; g < G; g++) {
          const float* qg = qb + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; d++) dot += qg[d] * kf[d];
          s[g][j] = dot * scale;
        }
      }
      for (int64_t g = 0; g < G; g++) {
        float mt = m[g];
        for (int j = 0; j < nt; j++) mt = s[g][j] > mt ? s[g][j] : mt;
        const float c = exp_le0(m[g] - mt);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < nt; j++) {
          s[g][j] = exp_le0(s[g][j] - mt);
          sum += s[g][j];
        }
        l[g] = l[g] * c + sum;
        m[g] = mt;
        float* a = acc[g];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) a[d] *= c;
      }
      for (int j = 0; j < nt; j++) {
        const T* vp = vrow[j];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) kf[d] = load_kv<T>(vp[d]);
        for (int64_t g = 0; g < G; g++) {
          float* a = acc[g];
          const float p = s[g][j];
#pragma omp simd
          for (int64_t d = 0; d < D; d++) a[d] += p * kf[d];
        }
      }
    }
    for (int64_t g = 0; g < G; g++) {
      float* o = out + (b * H + h * G + g) * D;
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
    }
  }
}

template <typename T>
static void decode(const float* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* st, const int64_t* lens,
                   int64_t H, int64_t Hkv, int64_t D, int64_t nb, int64_t bs, float scale, int64_t window,
                   float* out, int64_t begin, int64_t end) {
  if (D == 64) decode_items<T, 64>(q, kc, vc, bt, st, lens, H, Hkv, D, nb, bs, scale, window, out, begin, end);
  else if (D == 128) decode_items<T, 128>(q, kc, vc, bt, st, lens, H, Hkv, D, nb, bs, scale, window, out, begin, end);
  else decode_items<T, 0>(q, kc, vc, bt, st, lens, H, Hkv, D, nb, bs, scale, window, out, begin, end);
}

// q [B, H, D] float32; caches [Hkv, num_blocks, bs, D] float32 or bfloat16; tables: every context's
// blocks concatenated (int64), context b's from starts[b]; lens [B] keys per context.  Items below
// min_work products in all run in the calling thread (no fork of torch's pool for a few microseconds).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& starts, const at::Tensor& lens, double scale,
                        int64_t window, int64_t min_work) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous()
              && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type()
              && (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "k_cache, v_cache: contiguous float32 or bfloat16 [Hkv, num_blocks, block_size, D], alike");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0 && H / Hkv <= MAX_G && D <= MAX_D, "unsupported head shape");
  for (const at::Tensor* t : {&tables, &starts, &lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "tables, starts, lens: contiguous int64");
  TORCH_CHECK(starts.numel() == B && lens.numel() == B, "starts, lens: one per context");
  at::Tensor out = at::empty_like(q);
  const int64_t items = B * Hkv, nb = k_cache.size(1), bs = k_cache.size(2);
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t keys = 0;
  for (int64_t b = 0; b < B; b++) keys += lp[b];
  // at::parallel_for runs a range no longer than its grain inline
  const int64_t grain = keys * H * D < min_work ? items : 1;
  const float* qp = q.data_ptr<float>();
  const int64_t *bt = tables.data_ptr<int64_t>(), *st = starts.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const bool f32 = k_cache.scalar_type() == at::kFloat;
  at::parallel_for(0, items, grain, [&](int64_t a, int64_t b) {
    if (f32)
      decode<float>(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, st, lp, H, Hkv, D, nb, bs,
                    (float)scale, window, op, a, b);
    else
      decode<uint16_t>(qp, (const uint16_t*)k_cache.data_ptr(), (const uint16_t*)v_cache.data_ptr(), bt, st, lp, H,
                       Hkv, D, nb, bs, (float)scale, window, op, a, b);
  });
  return out;
}

TORCH_LIBRARY(interlace_attn, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor starts, Tensor lens, "
        "float scale, int window, int min_work) -> Tensor", &paged_decode);
}
"""

#: extra compiler flags (tests add one to force a fresh build)
FLAGS: tuple = ()

# Below this many (key x query head x head dim) products a decode step's attention runs in the calling
# thread: measured at batch 1, handing two of three KV heads to another thread took ~130 us per layer,
# 22% of a decode step, for ~25 us of arithmetic.
PARALLEL_MIN_WORK = 1 << 19

_lock = threading.Lock()
_loaded: dict = {}


class PagedDecodeKernel:
    """The compiled kernel (``torch.ops.interlace_attn.paged_decode``)."""

    def __init__(self, ops) -> None:
        self._op = ops.paged_decode

    def supports(self, kv_dtype: torch.dtype, group: int, head_dim: int) -> bool:
        return kv_dtype in (torch.float32, torch.bfloat16) and group <= 16 and head_dim <= 256

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
        """q [B, H, D] float32; k_cache/v_cache [Hkv, num_blocks, bs, D] (one layer, contiguous);
        ``tables`` every context's blocks, concatenated (int64), context ``b``'s from ``starts[b]``;
        ``lens`` [B] int64 keys per context.  Returns [B, H, D] float32.  The (context, KV head)
        items are split over torch's threads (its own OpenMP pool) unless the work is below
        :data:`PARALLEL_MIN_WORK`."""
        return self._op(q.contiguous(), k_cache, v_cache, tables, starts, lens, float(scale), int(window),
                        PARALLEL_MIN_WORK)


def load(cache_dir: Optional[Path] = None) -> Optional[PagedDecodeKernel]:
    """The kernel, built on first use (a few seconds) and cached; ``None`` where it cannot be built."""
    with _lock:
        key = (cache_dir, FLAGS)
        if key in _loaded:
            return _loaded[key]
        kernel = None
        try:
            command, libs = cbuild.torch_command()
            cbuild.load_torch_ops("paged_decode", SOURCE, [*command, *FLAGS], libs, cache_dir,
                                  "the CPU decode-attention kernel")
            kernel = PagedDecodeKernel(torch.ops.interlace_attn)
        except (OSError, RuntimeError, cbuild.BuildError) as e:
            log.warning("the CPU paged-attention kernel is not available (%s); decode attention gathers the "
                        "cache with torch instead", e)
        _loaded[key] = kernel
        return kernel
