"""Decode attention over the paged KV cache on CPU as one C++ operator.

The compiled CPU graphs used to read the cache in place through inductor's code for
`layers.inline_paged_attention` (broadcast products and reductions with indirect loads). That
code handles every (query, context position, head) element on its own: on the default model
it took 26 us per layer for one query row (~150 positions) and 46 us for two, about a fifth
of a batch-1 decode step and most of what a verify row costs over a plain one.

`mtpserve_attn::paged` does the same arithmetic per (row, query, KV head): the query heads of
the group against each visible context position's key (a dot product over the head dim),
the softmax in float32 (with the sink logit where the model has one), then the values
weighted. It reads only positions the query may see (causal: <= its position; sliding
window: the last `window`), so nothing is masked after the fact. A query's result does not
depend on the other queries or rows of the batch (batch-invariant, like the bf16-weight
linears), which keeps speculative == plain decoding exact. Float32 queries and cache, head
dims that are multiples of 16; elsewhere the inductor path stays.
"""

from __future__ import annotations

import functools
import os

import torch

from mtpserve.workers.model import cpp_ops

ENV = "MTPSERVE_CPU_ATTENTION"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

// exp(x) for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 Taylor
// polynomial (relative error < 2e-8 before rounding), times 2^n by scalef; -inf gives 0.
inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693145751953125f);
  const __m512 ln2_lo = _mm512_set1_ps(1.428606765330187e-06f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 y = _mm512_set1_ps(1.f / 5040.f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 720.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 120.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 24.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 6.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Lane sums of 16 vectors at once (a transposing add tree: ~2 shuffles and adds per sum
// where one horizontal reduction takes ~10 dependent ops); each output lane is one input's
// sum in a fixed order, independent of the other inputs. The lanes come out permuted:
// `key_order` gives the permutation that puts input j's sum in lane j.
inline __m512 sum16(const __m512* a) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: 8 partials of each input
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: 4 partials
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // 2 partials
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
}

__m512i key_order() {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_set1_ps(float(j));  // input j sums to 16 j
  alignas(64) float w[16];
  alignas(64) int32_t idx[16];
  _mm512_store_ps(w, sum16(a));
  for (int i = 0; i < 16; ++i) idx[int(w[i] / 16.f + 0.5f)] = i;
  return _mm512_load_si512(idx);
}

// out[b, s, h * D:(h + 1) * D] for the G query heads h = hk * G .. hk * G + G - 1 that share
// KV head hk, one head after the other.
void one(const float* q, const float* kbase, const float* vbase, const int64_t* tidx,
         int64_t lo, int64_t hi, int64_t Hk, int64_t D, int64_t G, int64_t hk, float scale,
         const float* sinks, float* out, std::vector<float>& sc, __m512i order) {
  const int64_t n = hi - lo + 1, DV = D / 16, np = (n + 15) / 16 * 16;
  sc.assign(G * np, -INFINITY);
  const int64_t row = Hk * D;  // floats per cache slot (one position, all KV heads)
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float* s = sc.data() + g * np;
    for (int64_t l0 = lo; l0 <= hi; l0 += 16) {  // 16 keys' dot products, summed together
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const float* k = kbase + tidx[std::min(l0 + j, hi)] * row + hk * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(k));
        for (int64_t d = 1; d < DV; ++d)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d * 16), _mm512_loadu_ps(k + d * 16), a);
        acc[j] = a;
      }
      const __m512 dot = _mm512_mul_ps(_mm512_permutexvar_ps(order, sum16(acc)), vscale);
      const int64_t valid = std::min<int64_t>(16, hi - l0 + 1);  // lanes past hi: -inf
      _mm512_storeu_ps(s + (l0 - lo), _mm512_mask_blend_ps(
          (__mmask16)((1u << valid) - 1), _mm512_set1_ps(-INFINITY), dot));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = sc.data() + g * np;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < np; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
    const float sink = sinks ? sinks[hk * G + g] : -INFINITY;
    const float top = std::max(_mm512_reduce_max_ps(mx), sink);
    const __m512 t = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < np; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), t));
      _mm512_storeu_ps(s + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float total = _mm512_reduce_add_ps(sum) + (sinks ? std::exp(sink - top) : 0.f);
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int64_t i = 0; i < np; i += 16)
      _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* p = sc.data() + g * np;
    float* o = out + g * D;
    for (int64_t d0 = 0; d0 < DV; d0 += 4) {  // 4 vectors of the head dim at a time
      const int64_t m = std::min<int64_t>(4, DV - d0);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
      for (int64_t l = lo; l <= hi; ++l) {
        const float* v = vbase + tidx[l] * row + hk * D + d0 * 16;
        const __m512 w = _mm512_set1_ps(p[l - lo]);
        for (int64_t j = 0; j < m; ++j)
          acc[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + j * 16), acc[j]);
      }
      for (int64_t j = 0; j < m; ++j) _mm512_storeu_ps(o + (d0 + j) * 16, acc[j]);
    }
  }
}

at::Tensor paged(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& token_index,
                 const at::Tensor& positions, double scale, int64_t window,
                 const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat,
              "paged attention: float32 queries and cache");
  TORCH_CHECK(q.dim() == 4 && kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(),
              "paged attention: q [B, S, Hq, D], kv [2, slots, Hk, D]");
  const int64_t B = q.size(0), S = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hk = kv.size(2), L = token_index.size(1), slots = kv.size(1);
  TORCH_CHECK(D % 16 == 0 && kv.size(3) == D && Hq % Hk == 0, "paged attention: head dims");
  const int64_t G = Hq / Hk;
  auto qc = q.contiguous();
  auto ti = token_index.to(at::kLong).contiguous();
  auto pos = positions.to(at::kLong).contiguous().view({B, S});
  c10::optional<at::Tensor> sk;
  if (sinks.has_value()) sk = sinks->to(at::kFloat).contiguous();
  auto out = at::empty({B, S, Hq * D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kv.data_ptr<float>();
  const float* vp = kp + slots * Hk * D;
  const int64_t* tp = ti.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* sp = sk.has_value() ? sk->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Check every slot a query may read first: compiled callers do not bounds-check.
  for (int64_t i = 0; i < B * L; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < slots, "paged attention: slot out of range");
  const int64_t work = B * S * Hk;
  // Items per thread: enough (position, head) pairs to pay for a fork / join.
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, L * G));
  static const __m512i order = key_order();
  at::parallel_for(0, work, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> sc;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t hk = w % Hk, bs = w / Hk, b = bs / S;
      const int64_t p = pp[bs];
      const int64_t hi = std::min<int64_t>(std::max<int64_t>(p, 0), L - 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      one(qp + (bs * Hq + hk * G) * D, kp, vp, tp + b * L, std::min(lo, hi), hi, Hk, D, G,
          hk, float(scale), sp, op + (bs * Hq + hk * G) * D, sc, order);
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(mtpserve_attn, m) {
  m.def("paged(Tensor q, Tensor kv, Tensor token_index, Tensor positions, float scale, "
        "int window, Tensor? sinks) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpserve_attn, CPU, m) {
  m.impl("paged", &paged);
}
"""


# A constant to torch.compile: dynamo cannot trace the CPU-capability query inside, and
# graphs that call `usable` (the in-process torch.compile path) would otherwise fail.
@functools.cache  # dynamo traces through the cache to the marked function
@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the operator runs here (AVX-512, `MTPSERVE_CPU_ATTENTION` not 0, built)."""
    if os.environ.get(ENV, "1") == "0" or not cpp_ops.has_avx512():
        return False
    if not cpp_ops.build("attn", _SOURCE, "the C++ paged attention"):
        return False

    @torch.library.register_fake("mtpserve_attn::paged")
    def _(q: torch.Tensor, kv: torch.Tensor, token_index: torch.Tensor,
          positions: torch.Tensor, scale: float, window: int,
          sinks: torch.Tensor | None) -> torch.Tensor:
        B, S, Hq, D = q.shape
        return q.new_empty((B, S, Hq * D))

    return True


def usable(q: torch.Tensor, flat_kv: torch.Tensor) -> bool:
    """Whether `paged` takes these inputs (else the caller keeps its own path)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and flat_kv.dtype == torch.float32 and q.shape[-1] % 16 == 0 and available())


def paged(q: torch.Tensor, flat_kv: torch.Tensor, token_index: torch.Tensor,
          positions: torch.Tensor, scale: float, window: int | None = None,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, S, Hq, D] over the cache flat_kv [2, slots, Hk, D]: query (b, s) sees context
    positions <= positions[b, s] (and > positions[b, s] - window), position l of row b at
    slot token_index[b, l]. Returns [B, S, Hq * D]."""
    return torch.ops.mtpserve_attn.paged(q, flat_kv, token_index, positions, scale,
                                         window or 0, sinks)
