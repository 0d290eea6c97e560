"""Quantized matrix products on the CPU in the GGUF block formats, and the decode step's small ops fused.

Batch-1 decode reads every weight once per token, so its speed is the bytes
per weight: float32 reads 4, fbgemm's fp16 GEMM (:mod:`.quant`'s other path)
2, a Q4 block 0.625 (16 bytes of codes and fp16 scale and offset per 32
weights, as in the GGUF).  This kernel keeps the weights in those blocks and
does the arithmetic in integers: each activation row is rounded per 32-group
to int16 with a scale (``round(x / (max|x| / 32767))``), a block's dot product
is int16 multiply-adds (``vpmaddwd``, AVX-VNNI ``vpdpwssd`` where the CPU has
it; a portable loop elsewhere), scaled once per block in float32, and a
block's offset (Q4_1's minimum) multiplies the exact float sum of the
activations' group.  llama.cpp rounds the activations to int8 instead, which
is cheaper but, measured on the embedded model, moved each matmul by 2-5%
(activations have outliers: one large value sets its group's step) and the
greedy output within 32 tokens on 14 of 20 prompts; int16 costs ~11% more
time and is more accurate than the fp16 GEMM (docs/quantization.md).

Layout: tiles of 16 output columns, the columns in the vector lanes.  For
each 32-group a tile holds the 16 columns' fp16 scales and offsets, then
their codes interleaved so that one 512-bit vector holds two consecutive
inputs' codes for all 16 columns; multiplied with that input pair broadcast
(``vpdpwssd``), it adds into 16 per-column int32 lanes.  Nothing is summed
across lanes, and one decoded weight vector serves a register block of up to
8 activation rows (4 with AVX2), so the same kernel is the fastest path here
at every batch size: at one row it reads 0.625 bytes a weight, and at 32 rows
(a batch-32 decode step) its multiply-adds run at twice fp32 FMA's rate --
1.65x fbgemm's fp16 GEMM over the embedded model's matrices, and faster at
prefill sizes too (docs/quantization.md).  Column tiles are split over
torch's threads (``at::parallel_for``: the same OpenMP pool as torch's own
kernels, so no second set of spinning threads).

``q4_linear(x, tiles, n)``: 4-bit codes (Q4_0, Q4_1; GGUF's nibble order).
``q8_linear(x, tiles, n)``: int8 codes (Q8_0; a 4-bit part fused into a Q8_0
matrix has codes -8..7 and an offset).  ``x`` is float32 ``[M, K]``.

``sample_top_p``: the sampler's kernel for rows without top-k (see
:mod:`.sampler`).

The fused ops (``rms_norm``, ``add_rms_norm_``, ``silu_mul``, ``rope_store``)
replace the ~40 eager torch ops around a layer's four matmuls -- ~8 ms of
dispatch per token at batch 1 -- for float32 engines with quantized weights
(``ModelRunner``; the dense float32 path stays the reference).

It is C++ against torch's headers, compiled on first use like
:mod:`.cpu_attention` (:mod:`.cbuild`: about 10 s, cached per CPU and torch
version) and registered as ``torch.ops.interlace_gguf``; :func:`load` returns
``None`` where it cannot be built, and :mod:`.quant` falls back to fbgemm's fp16 GEMM.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Optional, Tuple

import torch

from . import cbuild

log = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) bits = sign;
    else { float f = std::ldexp((float)man, -24); std::memcpy(&bits, &f, 4); bits |= sign; }
  } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
  else bits = sign | ((exp + 112) << 23) | (man << 13);
  float f; std::memcpy(&f, &bits, 4); return f;
}

// Activations as int16 per row and 32-group: codes round(x / dx) with dx = max|x| / 32767, plus each
// group's exact float sum for the blocks' offsets.  (llama.cpp rounds them to int8, 1/127 of the group's
// largest value: with the outliers of real activations that moved this model's matmuls by 2-5% and its
// greedy output within 32 tokens on 14 of 20 prompts; at 1/32767 the rounding is below fp16's.)
static void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* dx, float* xs) {
  const int64_t G = K / 32;
  for (int64_t i = 0; i < M * G; i++) {
    const float* v = x + i * 32;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < 32; j++) { amax = std::max(amax, std::fabs(v[j])); sum += v[j]; }
    const float d = amax / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; j++) xq[i * 32 + j] = (int16_t)std::nearbyint(v[j] * inv);
    dx[i] = d;
    xs[i] = sum;
  }
}

// ---------------------------------------------------------------- the quantized matmuls
// Tiles of 16 output columns (weight rows); for each 32-group g a tile holds the 16 columns' scales d
// (16 x fp16), their offsets m (16 x fp16), then the codes arranged so that one vector holds, for two
// consecutive inputs k, k + 1, the 16 columns' codes side by side: lane 2j + i = column j's code for
// input k + i.  An int16 multiply-add of that vector with the activation pair (x[k], x[k + 1]) broadcast
// (`vpdpwssd zmm, zmm, [mem]{1to16}`) adds both products into column j's int32 lane: the lanes are the
// output columns, so nothing is summed across lanes, one decoded weight vector serves every activation
// row of a register block (up to 8), and the per-group float work is one conversion and two FMAs per row
// per 16 columns.  Q4: 8 chunks of 32 bytes, chunk c's low nibbles the pair (4c, 4c + 1) and its high
// nibbles (4c + 2, 4c + 3); Q8: 16 chunks of 32 int8 codes, chunk p the pair (2p, 2p + 1).
constexpr int TC = 16;  // columns per tile
template <bool Q4> constexpr int64_t GCODES = Q4 ? 256 : 512;
template <bool Q4> constexpr int64_t GTILE = 64 + GCODES<Q4>;  // bytes per tile per group

static inline int32_t pair_at(const int16_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int RMAX = 8;  // activation rows per register block
static inline __m512i dot16(__m512i acc, __m512i w, int32_t xpair) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(xpair));
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(xpair)));
#endif
}

// R activation rows against one tile of 16 columns: y[r][0:cols] = sum_g d * dx * <codes, xq> + m * xs
template <bool Q4, int R>
static void gemm_block(const uint8_t* tile, const int16_t* xq, const float* dx, const float* xs, int64_t K,
                       int64_t G, float* y, int64_t N, int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const __m256i low = _mm256_set1_epi8(15);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* t = tile + g * GTILE<Q4>;
    for (int64_t i = 0; i < GTILE<Q4>; i += 64) __builtin_prefetch(t + 2 * GTILE<Q4> + i, 0, 3);
    __m512i ia[R];
    for (int r = 0; r < R; r++) ia[r] = _mm512_setzero_si512();
    const int16_t* xg = xq + g * 32;
    if constexpr (Q4) {
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) {
        const __m256i b = _mm256_loadu_si256((const __m256i*)(t + 64 + 32 * c));
        const __m512i w0 = _mm512_cvtepu8_epi16(_mm256_and_si256(b, low));
        const __m512i w1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), low));
        for (int r = 0; r < R; r++) {
          ia[r] = dot16(ia[r], w0, pair_at(xg + r * K + 4 * c));
          ia[r] = dot16(ia[r], w1, pair_at(xg + r * K + 4 * c + 2));
        }
      }
    } else {
#pragma GCC unroll 16
      for (int p = 0; p < 16; p++) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(t + 64 + 32 * p)));
        for (int r = 0; r < R; r++) ia[r] = dot16(ia[r], w, pair_at(xg + r * K + 2 * p));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)t));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t + 32)));
    for (int r = 0; r < R; r++) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]), acc[r]);
    }
  }
  const __mmask16 keep = cols >= TC ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
  for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * N, keep, acc[r]);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr int RMAX = 4;
// a += the 8 int32 sums of adjacent products of a and b's 16 int16 lanes
static inline __m256i madd16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
template <bool Q4, int R>
static void gemm_block(const uint8_t* tile, const int16_t* xq, const float* dx, const float* xs, int64_t K,
                       int64_t G, float* y, int64_t N, int cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* t = tile + g * GTILE<Q4>;
    for (int64_t i = 0; i < GTILE<Q4>; i += 64) __builtin_prefetch(t + 2 * GTILE<Q4> + i, 0, 3);
    __m256i ia[R][2];
    for (int r = 0; r < R; r++) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
    const int16_t* xg = xq + g * 32;
    constexpr int P = Q4 ? 8 : 16;
    for (int c = 0; c < P; c++) {
      for (int h = 0; h < 2; h++) {  // the 16 bytes of columns 0-7, then 8-15
        const __m128i b = _mm_loadu_si128((const __m128i*)(t + 64 + 32 * c + 16 * h));
        if constexpr (Q4) {
          const __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
          const __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
          for (int r = 0; r < R; r++) {
            ia[r][h] = madd16(ia[r][h], w0, _mm256_set1_epi32(pair_at(xg + r * K + 4 * c)));
            ia[r][h] = madd16(ia[r][h], w1, _mm256_set1_epi32(pair_at(xg + r * K + 4 * c + 2)));
          }
        } else {
          const __m256i w = _mm256_cvtepi8_epi16(b);
          for (int r = 0; r < R; r++) ia[r][h] = madd16(ia[r][h], w, _mm256_set1_epi32(pair_at(xg + r * K + 2 * c)));
        }
      }
    }
    for (int h = 0; h < 2; h++) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + 16 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + 32 + 16 * h)));
      for (int r = 0; r < R; r++) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * G + g])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * G + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float out[TC];
    _mm256_storeu_ps(out, acc[r][0]);
    _mm256_storeu_ps(out + 8, acc[r][1]);
    std::memcpy(y + r * N, out, sizeof(float) * cols);
  }
}
#else
constexpr int RMAX = 4;
template <bool Q4, int R>
static void gemm_block(const uint8_t* tile, const int16_t* xq, const float* dx, const float* xs, int64_t K,
                       int64_t G, float* y, int64_t N, int cols) {
  float acc[R][TC] = {};
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* t = tile + g * GTILE<Q4>;
    for (int j = 0; j < cols; j++) {
      uint16_t h[2];
      std::memcpy(&h[0], t + 2 * j, 2);
      std::memcpy(&h[1], t + 32 + 2 * j, 2);
      const float d = half_to_float(h[0]), m = half_to_float(h[1]);
      for (int r = 0; r < R; r++) {
        int32_t sum = 0;
        for (int k = 0; k < 32; k++) {
          int code;
          if (Q4) { const uint8_t b = t[64 + 32 * (k / 4) + 2 * j + k % 2]; code = (k % 4) < 2 ? b & 15 : b >> 4; }
          else code = (int)(int8_t)t[64 + 32 * (k / 2) + 2 * j + k % 2];
          sum += xq[r * K + g * 32 + k] * code;
        }
        acc[r][j] += d * dx[r * G + g] * (float)sum + m * xs[r * G + g];
      }
    }
  }
  for (int r = 0; r < R; r++) std::memcpy(y + r * N, acc[r], sizeof(float) * cols);
}
#endif

template <bool Q4, int R = RMAX>
static void gemm_rows(int rows, const uint8_t* tile, const int16_t* xq, const float* dx, const float* xs, int64_t K,
                      int64_t G, float* y, int64_t N, int cols) {
  if constexpr (R > 1) {
    if (rows < R) return gemm_rows<Q4, R - 1>(rows, tile, xq, dx, xs, K, G, y, N, cols);
  }
  gemm_block<Q4, R>(tile, xq, dx, xs, K, G, y, N, cols);
}

template <bool Q4>
static at::Tensor linear(const at::Tensor& x, const at::Tensor& tiles, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, T = (N + TC - 1) / TC;
  TORCH_CHECK(K % 32 == 0 && tiles.dim() == 2 && tiles.size(0) == T && tiles.size(1) == G * GTILE<Q4>
              && tiles.is_contiguous() && tiles.scalar_type() == at::kByte,
              "tiles: uint8 [ceil(N/16), K/32 * tile bytes] for x's K");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kShort));
  at::Tensor aux = at::empty({2, M, G}, x.options());
  int16_t* xqp = xq.data_ptr<int16_t>();
  float *dxp = aux.data_ptr<float>(), *xsp = dxp + M * G, *yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    quantize_rows(xp + a * K, b - a, K, xqp + a * K, dxp + a * G, xsp + a * G);
  });
  const int64_t grain = std::max<int64_t>(1, T / (4 * at::get_num_threads()));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int cols = (int)std::min<int64_t>(TC, N - t * TC);
      for (int64_t r = 0; r < M; r += RMAX)  // the tile stays in L1 across the row blocks
        gemm_rows<Q4>((int)std::min<int64_t>(RMAX, M - r), qp + t * G * GTILE<Q4>, xqp + r * K, dxp + r * G,
                      xsp + r * G, K, G, yp + r * N + t * TC, N, cols);
    }
  });
  return y;
}

// ---------------------------------------------------------------- the decode step's small ops, fused
// At batch 1 a decoder layer is ~40 eager torch ops around four matmuls, ~8 ms of dispatch per token
// for the embedded model: these do the same arithmetic (float32) in one call each.

static inline void norm_row(const float* x, const float* w, float eps, int64_t D, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < D; i++) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / (float)D + eps);
#pragma omp simd
  for (int64_t i = 0; i < D; i++) y[i] = w[i] * (x[i] * inv);
}

static void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [T, D]");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w: float32 [D]");
}

// RMSNorm: w * x / sqrt(mean(x^2) + eps)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  at::Tensor y = at::empty_like(x);
  const int64_t D = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; t++) norm_row(xp + t * D, wp, (float)eps, D, yp + t * D);
  });
  return y;
}

// The residual stream: x += delta (in place), then RMSNorm(x)
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == at::kFloat && delta.is_contiguous(), "delta like x");
  at::Tensor y = at::empty_like(x);
  const int64_t D = x.size(1);
  float *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; t++) {
#pragma omp simd
      for (int64_t i = 0; i < D; i++) xp[t * D + i] += dp[t * D + i];
      norm_row(xp + t * D, wp, (float)eps, D, yp + t * D);
    }
  });
  return y;
}

// silu(gate) * up for gate_up = [gate | up] along the last dimension
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gate_up: contiguous float32 [T, 2I]");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor y = at::empty({T, I}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; t++)
      for (int64_t i = 0; i < I; i++) {
        const float v = g[t * 2 * I + i];
        yp[t * I + i] = v / (1.f + std::exp(-v)) * g[t * 2 * I + I + i];
      }
  });
  return y;
}

// Rotary embedding (rotate-half, as Hugging Face's Llama) on q and k of a fused qkv projection,
// k and v written into the paged cache at their slots; returns q [T, H, D].
template <typename C>
static void rope_rows(const float* qkv, const float* cs, const float* sn, const int64_t* slots, int64_t H, int64_t Hkv,
                      int64_t D, int64_t NB, int64_t BS, C* kc, C* vc, float* q, int64_t a, int64_t b) {
  const int64_t half = D / 2, W = (H + 2 * Hkv) * D;
  for (int64_t t = a; t < b; t++) {
    const float *row = qkv + t * W, *c = cs + t * D, *s = sn + t * D;
    for (int64_t h = 0; h < H + Hkv; h++) {
      const float* v = row + h * D;
      float out[512];
      for (int64_t i = 0; i < half; i++) {
        out[i] = v[i] * c[i] - v[i + half] * s[i];
        out[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
      }
      if (h < H) {
        std::memcpy(q + (t * H + h) * D, out, sizeof(float) * D);
      } else {
        C* dst = kc + ((h - H) * NB * BS + slots[t]) * D;
        for (int64_t i = 0; i < D; i++) dst[i] = (C)out[i];
      }
    }
    for (int64_t h = 0; h < Hkv; h++) {
      const float* v = row + (H + Hkv + h) * D;
      C* dst = vc + (h * NB * BS + slots[t]) * D;
      for (int64_t i = 0; i < D; i++) dst[i] = (C)v[i];
    }
  }
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t Hkv,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(), "qkv: contiguous float32");
  const int64_t T = qkv.size(0), D = k_cache.size(3), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D && D % 2 == 0 && D <= 512, "qkv width or head size");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == T * D && cos.scalar_type() == at::kFloat
              && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "cos, sin: float32 [T, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == Hkv && k_cache.is_contiguous()
              && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(), "caches [Hkv, blocks, bs, D]");
  TORCH_CHECK(slots.numel() == T && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: int64 [T]");
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const float *x = qkv.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) TORCH_CHECK(sl[t] >= 0 && sl[t] < NB * BS, "slot out of range");
  float* qp = q.data_ptr<float>();
  if (k_cache.scalar_type() == at::kFloat) {
    float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) { rope_rows(x, c, s, sl, H, Hkv, D, NB, BS, kc, vc, qp, a, b); });
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "cache dtype: float32 or bfloat16");
    at::BFloat16 *kc = k_cache.data_ptr<at::BFloat16>(), *vc = v_cache.data_ptr<at::BFloat16>();
    at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) { rope_rows(x, c, s, sl, H, Hkv, D, NB, BS, kc, vc, qp, a, b); });
  }
  return q;
}

// ---------------------------------------------------------------- sampling without a sort
""" + cbuild.EXP_LE0 + r"""
constexpr int BINS_PER_NAT = 16, NBINS = 1024;  // log-probability gaps of 0..64 nats, the last bin open

// One token per row from softmax(logits / T) restricted to its top-p nucleus, by inverse CDF with the
// row's uniform u: exact, and no sort of the vocabulary.  The nucleus (the fewest most likely tokens
// whose mass reaches top_p) is found from a histogram of the tokens' log-probability gaps below the
// best: every bin before the one where the mass crosses top_p is kept whole, and only that bin's tokens
// are sorted.  The draw walks the kept tokens in vocabulary order.  -1: nothing to sample (NaN, +inf,
// or every logit -inf).
constexpr int64_t CHUNK = 512;  // the draw finds its chunk from per-chunk sums, then walks one chunk

static int64_t sample_row(const float* x, int64_t V, float T, float top_p, double u,
                          std::vector<std::pair<float, int64_t>>& bin, std::vector<float>& wbuf, std::vector<int16_t>& bbuf,
                          std::vector<double>& h, std::vector<double>& cs) {
  float xmax = -INFINITY;
  int bad = 0;
#pragma omp simd reduction(max : xmax) reduction(| : bad)
  for (int64_t i = 0; i < V; i++) {
    bad |= (x[i] != x[i]) | (x[i] == INFINITY);
    xmax = x[i] > xmax ? x[i] : xmax;
  }
  if (bad || xmax == -INFINITY) return -1;
  const float inv = 1.f / T;
  const bool nucleus = top_p < 1.f;
  wbuf.resize(V);
  bbuf.resize(V);
  float* w = wbuf.data();
  int16_t* bn = bbuf.data();
  // each token's weight e^((x - max) / T) and its gap's bin, once (-inf logits: weight 0, no bin); two
  // loops, because GCC vectorizes neither pass written as one (with -fno-trapping-math: 13x faster)
#pragma omp simd
  for (int64_t i = 0; i < V; i++) w[i] = exp_le0((x[i] - xmax) * inv);
#pragma omp simd
  for (int64_t i = 0; i < V; i++) {
    const float b = (xmax - x[i]) * inv * BINS_PER_NAT;
    const bool ninf = x[i] == -INFINITY;
    bn[i] = ninf ? (int16_t)NBINS : (int16_t)(b >= NBINS - 1 ? NBINS - 1 : (int)b);
    w[i] = ninf ? 0.f : w[i];
  }
  int cut = NBINS;            // bins before it are kept whole
  float w_last = 0.f;         // in bin `cut`: tokens above w_last, and at w_last those up to index i_last
  int64_t i_last = -1;
  if (nucleus) {
    // the histogram of the weights by bin: four interleaved copies, so consecutive tokens in one bin
    // (most of them are in a few) are not one chain of dependent additions
    h.assign(4 * (NBINS + 1), 0.0);
    int64_t i = 0;
    for (; i + 4 <= V; i += 4)
      for (int c = 0; c < 4; c++) h[c * (NBINS + 1) + bn[i + c]] += w[i + c];
    for (; i < V; i++) h[bn[i]] += w[i];
    double Z = 0.0;
    for (int b = 0; b < NBINS; b++) Z += h[b] + h[NBINS + 1 + b] + h[2 * (NBINS + 1) + b] + h[3 * (NBINS + 1) + b];
    const double target = (double)top_p * Z;
    double cum = 0.0;
    int b = 0;
    auto mass = [&](int k) { return h[k] + h[NBINS + 1 + k] + h[2 * (NBINS + 1) + k] + h[3 * (NBINS + 1) + k]; };
    while (b < NBINS - 1 && cum + mass(b) < target) cum += mass(b++);
    cut = b;
    bin.clear();
    for (int64_t j = 0; j < V; j++)
      if (bn[j] == b) bin.emplace_back(w[j], j);
    std::sort(bin.begin(), bin.end(), [](const auto& a, const auto& c) {
      return a.first > c.first || (a.first == c.first && a.second < c.second);
    });
    for (const auto& [wi, j] : bin) {
      cum += wi;
      w_last = wi;
      i_last = j;
      if (cum >= target) break;
    }
  }
  // the kept tokens' weights per chunk (a vector pass), then the draw: u times their total, found by
  // walking the chunk sums and then the one chunk where the cumulative weight passes it
  auto kept = [&](int64_t i) { return bn[i] < cut || (bn[i] == cut && (w[i] > w_last || (w[i] == w_last && i <= i_last))); };
  const int64_t nc = (V + CHUNK - 1) / CHUNK;
  cs.resize(nc);
  double total = 0.0;
  for (int64_t c = 0; c < nc; c++) {
    const int64_t e = std::min(V, (c + 1) * CHUNK);
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = c * CHUNK; i < e; i++) sum += kept(i) ? (double)w[i] : 0.0;
    cs[c] = sum;
    total += sum;
  }
  const double goal = u * total;
  double cum = 0.0;
  int64_t last = -1;
  for (int64_t c = 0; c < nc; c++) {
    if (cs[c] == 0.0) continue;
    if (cum + cs[c] <= goal && c + 1 < nc) {  // not in this chunk (a rounding short of the last falls through)
      cum += cs[c];
      for (int64_t i = std::min(V, (c + 1) * CHUNK) - 1; i >= c * CHUNK; i--)
        if (kept(i)) { last = i; break; }
      continue;
    }
    for (int64_t i = c * CHUNK, e = std::min(V, (c + 1) * CHUNK); i < e; i++) {
      if (!kept(i)) continue;
      cum += w[i];
      last = i;
      if (cum > goal) return i;
    }
  }
  return last;  // u * total rounded past the walk's sum
}

at::Tensor sample_top_p(const at::Tensor& logits, const at::Tensor& temp, const at::Tensor& top_p, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), "logits: float32 [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temp.numel() == R && top_p.numel() == R && u.numel() == R && temp.scalar_type() == at::kFloat
              && top_p.scalar_type() == at::kFloat && u.scalar_type() == at::kDouble, "temp, top_p: float32 [R]; u: float64 [R]");
  at::Tensor tok = at::empty({R}, logits.options().dtype(at::kLong));
  const float *x = logits.data_ptr<float>(), *tp = temp.contiguous().data_ptr<float>(), *pp = top_p.contiguous().data_ptr<float>();
  const double* up = u.contiguous().data_ptr<double>();
  int64_t* out = tok.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t a, int64_t b) {
    std::vector<std::pair<float, int64_t>> bin;
    std::vector<float> wbuf;
    std::vector<int16_t> bbuf;
    std::vector<double> hbuf, cbuf;  // per thread, reused row to row
    for (int64_t r = a; r < b; r++)
      out[r] = sample_row(x + r * V, V, tp[r], pp[r], up[r], bin, wbuf, bbuf, hbuf, cbuf);
  });
  return tok;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n) { return linear<true>(x, tiles, n); }
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n) { return linear<false>(x, tiles, n); }

TORCH_LIBRARY(interlace_gguf, m) {
  m.def("q4_linear(Tensor x, Tensor tiles, int n) -> Tensor", &q4_linear);
  m.def("q8_linear(Tensor x, Tensor tiles, int n) -> Tensor", &q8_linear);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor w, float eps) -> Tensor", &add_rms_norm_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("sample_top_p(Tensor logits, Tensor temp, Tensor top_p, Tensor u) -> Tensor", &sample_top_p);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, int H, int Hkv, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> Tensor", &rope_store);
}
"""

_lock = threading.Lock()
_loaded: dict = {}


def _command() -> Tuple[list, list]:
    """The compiler command (against this torch's headers, for this CPU) and the libraries."""
    return cbuild.torch_command()


def load(cache_dir: Optional[Path] = None) -> Optional[object]:
    """``torch.ops.interlace_gguf`` (``q4_linear``, ``q8_linear``, the fused ops, ``sample_top_p``),
    built on first use and cached; ``None`` where it cannot be built (one log line says why)."""
    with _lock:
        if "ops" in _loaded:
            return _loaded["ops"]
        ops = None
        try:
            cbuild.load_torch_ops("gguf_matmul", SOURCE, *_command(), cache_dir,
                                  "the CPU kernels (GGUF matmuls, fused decode ops, sampler)")
            ops = torch.ops.interlace_gguf
        except (OSError, RuntimeError, cbuild.BuildError) as e:
            log.warning("the GGUF matmul kernel is not available (%s); quantized weights run through "
                        "fbgemm's fp16 GEMM instead", e)
        _loaded["ops"] = ops
        return ops


TILE_COLS = 16  # output columns per tile (``TC`` in the source)


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` (uint8 0..15: 4-bit; int8: 8-bit) with per-32-group fp16 ``d``, ``m`` ``[N, K/32]``
    as ``q4_linear``/``q8_linear``'s tiles ``[ceil(N/16), K/32 * tile bytes]``: per tile and group the 16
    columns' fp16 scales, their fp16 offsets, then the codes with the columns in the vector lanes (see the
    source; padded columns are zeros)."""
    n, k = codes.shape
    if k % 32:
        raise ValueError(f"input size {k} is not a multiple of 32")
    if codes.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"codes must be uint8 (4-bit) or int8, not {codes.dtype}")
    dm = torch.stack([d, m]).float()                                          # [2, N, G]
    half = dm.half()
    if not torch.equal(half.float(), dm):
        raise ValueError("block scales or offsets are not fp16 values")
    g, pad = k // 32, -n % TILE_COLS
    c = codes.view(torch.uint8)
    if pad:
        c = torch.cat([c, c.new_zeros(pad, k)])
        half = torch.cat([half, half.new_zeros(2, pad, g)], dim=1)
    t = (n + pad) // TILE_COLS
    c = c.view(t, TILE_COLS, g, 32).permute(0, 2, 3, 1)                       # [T, G, k, column]
    if codes.dtype == torch.uint8:
        c = c.reshape(t, g, 8, 2, 2, TILE_COLS).transpose(-1, -2)              # [T, G, chunk, nibble, column, k % 2]
        body = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(t, g, 256)
    else:
        body = c.reshape(t, g, 16, 2, TILE_COLS).transpose(-1, -2).reshape(t, g, 512)
    heads = half.view(2, t, TILE_COLS, g).permute(1, 3, 0, 2).contiguous()   # [T, G, 2, 16] fp16
    heads = heads.view(torch.uint8).reshape(t, g, 64)
    return torch.cat([heads, body], dim=-1).reshape(t, -1).contiguous()


def dequantize(tiles: torch.Tensor, four_bit: bool, n: int, k: int) -> torch.Tensor:
    """The float32 weights ``[n, k]`` that :func:`pack`'s tiles hold (the reference the tests hold the kernel to)."""
    t, g = tiles.shape[0], k // 32
    b = tiles.view(t, g, -1)
    dm = b[..., :64].contiguous().view(torch.float16).float().view(t, g, 2, TILE_COLS)
    body = b[..., 64:]
    if four_bit:
        c = body.reshape(t, g, 8, TILE_COLS, 2)
        codes = torch.stack([c & 15, c >> 4], dim=3)                           # [T, G, chunk, nibble, column, k % 2]
        codes = codes.permute(0, 1, 4, 2, 3, 5).reshape(t, g, TILE_COLS, 32).float()
    else:
        codes = body.contiguous().view(torch.int8).reshape(t, g, 16, TILE_COLS, 2)
        codes = codes.permute(0, 1, 3, 2, 4).reshape(t, g, TILE_COLS, 32).float()
    w = codes * dm[:, :, 0, :, None] + dm[:, :, 1, :, None]                   # [T, G, column, 32]
    return w.permute(0, 2, 1, 3).reshape(t * TILE_COLS, k)[:n]
