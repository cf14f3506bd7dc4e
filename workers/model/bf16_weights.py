"""Float32 linears whose weights are stored in bf16: half the bytes, the same products.

A checkpoint shipped in bf16 and served in float32 (the CPU default) holds weights that bf16
represents exactly. A decode step at small batch is bound by streaming those weights (the
default model's main forward read its 38 MB at ~11 GB/s on one core here), so this keeps each
such linear's weight a second time as bf16 bits, packed in blocks of 64 output columns
([N / 64, K, 64]: one forward streams it in order), and multiplies with a small AVX-512 kernel
that widens each weight to float32 exactly (a 16-bit shift) and accumulates in float32.

Every output element is one fused multiply-add chain over K in order, whatever the number of
rows up to `MAX_ROWS`: a row's result does not depend on the batch or the query length it
runs in (MKL's SGEMM blocks differently for different M), which is what speculative == plain
decoding asks. Larger batches (prefill chunks, many verify rows) are bound by arithmetic
rather than bytes and take the float32 GEMM. The values equal the float32 product up to
summation order.

The kernel is a C++ operator (`mtpserve_bf16w::linear`, built once per machine with the
compiler inductor already needs, ~20 s) so compiled graphs call it without Python. Used when
the model runs in float32 on a CPU with AVX-512 and the weight round-trips through bf16;
`MTPSERVE_BF16_WEIGHTS=0` turns it off (for comparison).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from mtpserve.workers.model import cpp_ops

ENV = "MTPSERVE_BF16_WEIGHTS"
BLOCK = 64  # output columns per packed block (4 AVX-512 vectors)
# Above this many rows the float32 GEMM runs instead (same result up to summation order).
# Measured here, one thread, the default model's 49 linears in a row: 1 row 1.76x faster
# than float32, 2-4 rows 2.0x, 10 rows 1.69x, 32 rows 1.02x, 96 rows 0.91x.
MAX_ROWS = 24

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

namespace {
constexpr int64_t NBW = 64;

// MT rows x 64 columns of y = x @ W^T, W's block packed [K][64] as bf16 bits, interleaved
// (`pack`): 32-bit word i of half h (32 columns) holds column 32h + i in its low 16 bits and
// column 32h + 16 + i in its high ones, so one shift (low) or one mask (high) widens 16
// weights to float32: half the conversion work of widening 16-bit lanes, which bounds the
// one-row product. Each output is one FMA chain over k = 0..K-1, the same for every MT.
template <int MT>
inline void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t K, float* y,
                 int64_t ldy, int64_t nvalid) {
  const __m512i hi = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 acc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t* wk = w + k * NBW;
    __m512 wv[4];
    for (int h = 0; h < 2; ++h) {
      __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(wk + h * 32));
      wv[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wv[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
    }
    for (int m = 0; m < MT; ++m) {
      __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xb, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < 4; ++r) {
      int64_t left = nvalid - r * 16;
      if (left <= 0) break;
      __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      _mm512_mask_storeu_ps(y + m * ldy + r * 16, mask, acc[m][r]);
    }
}

// Blocks [b0, b1) of one packed weight (block b at w + b * K * 64) for M rows (row stride
// K; y row stride n): 6 rows at a time, then the rest.
inline void span(const float* xp, int64_t M, int64_t K, const uint16_t* w, int64_t b0,
                 int64_t b1, float* y, int64_t n) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* wb = w + b * K * NBW;
    const int64_t nvalid = std::min<int64_t>(NBW, n - b * NBW);
    float* yb = y + b * NBW;
    int64_t m = 0;
    for (; M - m >= 6; m += 6) tile<6>(xp + m * K, K, wb, K, yb + m * n, n, nvalid);
    const float* xr = xp + m * K;
    float* yr = yb + m * n;
    switch (M - m) {
      case 5: tile<5>(xr, K, wb, K, yr, n, nvalid); break;
      case 4: tile<4>(xr, K, wb, K, yr, n, nvalid); break;
      case 3: tile<3>(xr, K, wb, K, yr, n, nvalid); break;
      case 2: tile<2>(xr, K, wb, K, yr, n, nvalid); break;
      case 1: tile<1>(xr, K, wb, K, yr, n, nvalid); break;
      default: break;
    }
  }
}

// Blocks per thread: a parallel region costs a fork / join (microseconds on a small VM), so
// a weight is split across threads only in chunks of at least this many weight elements.
constexpr int64_t kMinParallel = int64_t(1) << 17;

inline int64_t grain(int64_t K) {
  return std::max<int64_t>(2, (kMinParallel / (K * NBW) + 1) & ~int64_t(1));
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                  int64_t max_rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bf16-weight linear: float32 input expected");
  const int64_t n = weight.size(0);
  // Many rows reuse each weight enough to be bound by arithmetic, where the float32 GEMM
  // is faster than widening bf16 in registers.
  if (x.numel() / x.size(-1) > max_rows) return at::linear(x, weight);
  TORCH_CHECK(packed.scalar_type() == at::kShort && packed.dim() == 3 &&
              packed.size(2) == NBW && packed.is_contiguous(), "bf16-weight linear: bad pack");
  const int64_t K = x.size(-1);
  TORCH_CHECK(packed.size(1) == K && n <= packed.size(0) * NBW, "bf16-weight linear: shape");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0), NB = packed.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty(sizes, x.options());
  if (M == 0 || n == 0) return y;
  const float* xp = x2.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, grain(K), [&](int64_t b0, int64_t b1) {
    span(xp, M, K, wp, b0, b1, yp, n);
  });
  return y;
}

// Routed experts: row m of x through expert idx[m] (weight [E, N, K], packed
// [E, N / 64, K, 64]). Rows are grouped by expert (a counting sort: stable, so a row's
// result is the same FMA chain whatever else is in the batch); more than max_rows rows take
// one float32 GEMM per used expert.
at::Tensor experts_linear(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& weight,
                          const at::Tensor& packed, int64_t max_rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2,
              "bf16-weight experts: float32 [rows, K] input expected");
  const int64_t M = x.size(0), K = x.size(1), E = weight.size(0), n = weight.size(1);
  TORCH_CHECK(idx.numel() == M, "bf16-weight experts: one expert id per row");
  auto ids = idx.to(at::kLong).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), order(M);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(ip[m] >= 0 && ip[m] < E, "bf16-weight experts: expert id out of range");
    ++start[ip[m] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> cursor(start.begin(), start.end() - 1);
    for (int64_t m = 0; m < M; ++m) order[cursor[ip[m]]++] = m;
  }
  auto y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  if (M > max_rows) {
    auto ord = at::from_blob(order.data(), {M}, at::kLong).clone();
    auto xs = x.index_select(0, ord);
    std::vector<at::Tensor> outs;
    for (int64_t e = 0; e < E; ++e)
      if (start[e + 1] > start[e])
        outs.push_back(at::linear(xs.narrow(0, start[e], start[e + 1] - start[e]), weight[e]));
    return y.index_copy_(0, ord, at::cat(outs));
  }
  TORCH_CHECK(packed.scalar_type() == at::kShort && packed.dim() == 4 &&
              packed.size(0) == E && packed.size(2) == K && packed.size(3) == NBW &&
              n <= packed.size(1) * NBW && packed.is_contiguous(),
              "bf16-weight experts: bad pack");
  const int64_t NB = packed.size(1);
  auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  std::vector<float> xs(M * K), ys(M * n);
  for (int64_t i = 0; i < M; ++i)
    std::memcpy(xs.data() + i * K, xp + order[i] * K, K * sizeof(float));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  at::parallel_for(0, NB, grain(K), [&](int64_t b0, int64_t b1) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t s = start[e], c = start[e + 1] - s;
      if (c > 0) span(xs.data() + s * K, c, K, wp + e * NB * K * NBW, b0, b1,
                      ys.data() + s * n, n);
    }
  });
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i)
    std::memcpy(yp + order[i] * n, ys.data() + i * n, n * sizeof(float));
  return y;
}
}  // namespace

TORCH_LIBRARY(mtpserve_bf16w, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor packed, int max_rows) -> Tensor");
  m.def("experts_linear(Tensor x, Tensor idx, Tensor weight, Tensor packed, int max_rows) "
        "-> Tensor");
}
TORCH_LIBRARY_IMPL(mtpserve_bf16w, CPU, m) {
  m.impl("linear", &linear);
  m.impl("experts_linear", &experts_linear);
}
"""


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: a CPU with AVX-512, the switch on, the operator built
    (once per machine; a failed build is logged once and the float32 weights are used)."""
    if os.environ.get(ENV, "1") == "0" or not cpp_ops.has_avx512():
        return False
    if not cpp_ops.build("bf16w", _SOURCE, "bf16-weight linears"):
        return False
    _register_fake()
    return True


def _register_fake() -> None:
    @torch.library.register_fake("mtpserve_bf16w::linear")
    def _(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor,
          max_rows: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("mtpserve_bf16w::experts_linear")
    def _(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor,
          max_rows: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[1]))


def exact_in_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 weight is a bf16 value (a bf16 checkpoint's are)."""
    return weight.dtype == torch.float32 and bool(
        torch.equal(weight.to(torch.bfloat16).float(), weight))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N / 64), K, 64] int16 (bf16 bits), zero columns past N; within
    a block's row the columns are interleaved by halves of 32 (c0, c16, c1, c17, ..., c32,
    c48, ...): the kernel widens a 32-bit word's low and high bf16 with one op each."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    w = weight.new_zeros(blocks * BLOCK, k, dtype=torch.bfloat16)
    w[:n] = weight.to(torch.bfloat16)
    w = w.view(blocks, BLOCK, k).transpose(1, 2)  # [NB, K, 64]
    w = w.reshape(blocks, k, 2, 2, 16).transpose(3, 4)  # (half, low/high, i) -> (half, i, l/h)
    return w.contiguous().view(torch.int16).view(blocks, k, BLOCK)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed bf16 copy of `weight` when it has one
    and `x` is float32 (a layer lowered to bf16 later keeps its own GEMM)."""
    if packed is None or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    y = torch.ops.mtpserve_bf16w.linear(x, weight, packed, MAX_ROWS)
    return y if bias is None else y + bias


def experts_linear(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
                   packed: torch.Tensor) -> torch.Tensor:
    """Routed experts' products: x [M, K] row m through expert idx[m] of weight [E, N, K]
    (packed [E, N / 64, K, 64]): the dense kernel's chains per row, grouped by expert in C++
    (no per-expert host loop, no weight copies); more rows than `MAX_ROWS` take one float32
    GEMM per used expert."""
    return torch.ops.mtpserve_bf16w.experts_linear(x, idx, weight, packed, MAX_ROWS)


def pack_experts(weight: torch.Tensor) -> torch.Tensor:
    """[E, N, K] float32 -> [E, ceil(N / 64), K, 64] int16, each expert as `pack` lays it."""
    return torch.stack([pack(w) for w in weight])


def packed_count(model: torch.nn.Module) -> int:
    """How many of `model`'s linears and expert stacks carry a packed bf16 copy (compiled
    graphs of those call the kernel, so the count is part of their fingerprint)."""
    return sum(getattr(m, "packed_bf16", None) is not None
               or getattr(m, "w13_packed", None) is not None for m in model.modules())


def pack_linears(model: torch.nn.Module) -> int:
    """Give every float32 linear of `model` whose weight bf16 holds exactly its packed copy
    (`packed_bf16`, a non-persistent buffer), and every float32 expert stack its own
    (`w13_packed` / `w2_packed`); returns how many. Call after the weights are
    final (loaded, sharded) and before compiling."""
    if not available():
        return 0
    n = 0
    for mod in model.modules():
        if hasattr(mod, "w13_packed"):  # moe.Experts (float32, not fp8)
            if (mod.w13.dtype == torch.float32 and mod.w13.device.type == "cpu"
                    and exact_in_bf16(mod.w13) and exact_in_bf16(mod.w2)):
                mod.register_buffer("w13_packed", pack_experts(mod.w13.detach()),
                                    persistent=False)
                mod.register_buffer("w2_packed", pack_experts(mod.w2.detach()),
                                    persistent=False)
                n += 1
            continue
        w = getattr(mod, "weight", None)
        if (hasattr(mod, "packed_bf16") and isinstance(w, torch.Tensor) and w.dim() == 2
                and w.device.type == "cpu" and exact_in_bf16(w)):
            mod.register_buffer("packed_bf16", pack(w.detach()), persistent=False)
            n += 1
    return n
