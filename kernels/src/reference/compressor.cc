// CPU reference of the KV compressors (spec/compressor.md), in fp32 as the spec states it.
#include "kvferry/kernels/compressor.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvferry/kernels/compressor_math.h"
#include "kvferry/kernels/numerics.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/kernels/validate.h"

namespace kvferry {

CompressorWindows CompressorEntries(int ratio, int64_t first_position, int64_t num_rows) {
  CompressorWindows w;
  if (ratio <= 0 || num_rows <= 0 || first_position < 0) return w;
  const int64_t span = CompressorSpan(ratio);
  // The first closing window p >= first_position whose first needed row max(0, p-span+1)
  // is given.
  int64_t p = first_position + (ratio - 1 - first_position % ratio) % ratio;
  while (std::max<int64_t>(0, p - span + 1) < first_position) p += ratio;
  const int64_t last = first_position + num_rows - 1;
  if (p > last) return w;
  w.first_end = p;
  w.count = (last - p) / ratio + 1;
  return w;
}

absl::Status ValidateCompressorParams(const CompressorParams& p) {
  if (p.ratio != 1 && p.ratio != 2 && p.ratio != 4 && p.ratio != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("compression ratio ", p.ratio, " is not one of 1, 2, 4, 128"));
  }
  if (!(p.eps > 0.0f) || !std::isfinite(p.eps)) {
    return absl::InvalidArgumentError(absl::StrCat("eps ", p.eps, " must be finite and > 0"));
  }
  KVF_RETURN_IF_ERROR(ValidateGeometry(p.geometry));
  if (p.fp4_fake_quant &&
      (p.ratio > 2 || p.geometry.layout == Layout::kV41Fp4)) {
    return absl::InvalidArgumentError(
        "FP4 fake quantization applies to ratio 1 or 2 into a v4 or v41 pool only");
  }
  if (p.num_rows < 0 || p.first_position < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative row count ", p.num_rows,
                                                   " or first position ", p.first_position));
  }
  const CompressorWindows w = CompressorEntries(p.ratio, p.first_position, p.num_rows);
  if (p.num_entries != w.count) {
    return absl::InvalidArgumentError(absl::StrCat(
        p.num_rows, " rows from position ", p.first_position, " close ", w.count,
        " windows of ratio ", p.ratio, ", but ", p.num_entries, " entry locations were given"));
  }
  if (w.count == 0) return absl::OkStatus();
  if (p.kv == nullptr || (p.ratio != 1 && p.score == nullptr) || p.norm_weight == nullptr ||
      p.rope_cos == nullptr || p.rope_sin == nullptr || p.pool == nullptr ||
      p.entry_locs == nullptr) {
    return absl::InvalidArgumentError("compressor input or output pointer is null");
  }
  const int64_t last_rope = w.first_end + (w.count - 1) * p.ratio + 1 - p.ratio;
  if (last_rope >= p.num_rope_positions) {
    return absl::InvalidArgumentError(absl::StrCat("RoPE table has ", p.num_rope_positions,
                                                   " positions, entry needs position ",
                                                   last_rope));
  }
  return absl::OkStatus();
}

namespace reference {
namespace {

// Steps 1-2: the pooled fp32 row of the window ending at `end`, channel by channel, rows
// in order; ratio 128 in blocks of rows folded in two levels (blocks within a CTA, then
// CTAs), as the kernels do.
void PoolWindow(const CompressorParams& p, int64_t end, float* pooled) {
  using compressor_math::OnlineSoftmax;
  const int64_t width = int64_t{CompressorCoff(p.ratio)} * kHeadDim;
  if (p.ratio == 1) {
    const float* kv = p.kv + (end - p.first_position) * width;
    for (int c = 0; c < kHeadDim; ++c) pooled[c] = kv[c];
    return;
  }
  const int64_t first = std::max<int64_t>(0, end - CompressorSpan(p.ratio) + 1);
  const bool split = p.ratio == 128;
  const int groups = split ? compressor_math::kC128Ctas : 1;
  const int blocks = split ? compressor_math::kC128BlocksPerCta : 1;
  const int64_t rows = split ? compressor_math::kC128RowsPerBlock : end - first + 1;
  // Folds `count` states made by `make(i)` in order.
  auto fold = [](int count, const auto& make) {
    OnlineSoftmax total = make(0);
    for (int i = 1; i < count; ++i) total.Merge(make(i));
    return total;
  };
  for (int c = 0; c < kHeadDim; ++c) {
    const OnlineSoftmax total = fold(groups, [&](int group) {
      return fold(blocks, [&](int block) {
        OnlineSoftmax state;
        const int64_t begin = first + (int64_t{group} * blocks + block) * rows;
        for (int64_t pos = begin; pos < begin + rows; ++pos) {
          // ratio 4: the previous window's rows read the first half, the current the second.
          const int64_t half = (p.ratio == 4 && pos > end - 4) ? kHeadDim : 0;
          const int64_t at = (pos - p.first_position) * width + half + c;
          state.AddRow(p.score[at], p.kv[at]);
        }
        return state;
      });
    });
    pooled[c] = total.Result();
  }
}

// Steps 3-4: RMSNorm and RoPE; returns the bf16 row.
void NormRotate(const CompressorParams& p, int64_t end, const float* pooled, uint16_t* row) {
  float h[kHeadDim];
  for (int c = 0; c < kHeadDim; ++c) h[c] = numerics::Bf16ToFloat(numerics::FloatToBf16(pooled[c]));
  const float inv_rms = compressor_math::InvRms(compressor_math::SumOfSquares(h), p.eps);
  float n[kHeadDim];
  for (int c = 0; c < kHeadDim; ++c) {
    n[c] = numerics::Bf16ToFloat(numerics::FloatToBf16(
        compressor_math::NormValue(h[c], inv_rms, numerics::Bf16ToFloat(p.norm_weight[c]))));
  }
  const int64_t q = end + 1 - p.ratio;
  for (int i = 0; i < kRopeDim / 2; ++i) {
    compressor_math::Rotate(n[kNopeDim + 2 * i], n[kNopeDim + 2 * i + 1],
                            p.rope_cos[q * (kRopeDim / 2) + i], p.rope_sin[q * (kRopeDim / 2) + i],
                            n[kNopeDim + 2 * i], n[kNopeDim + 2 * i + 1]);
  }
  for (int c = 0; c < kHeadDim; ++c) row[c] = numerics::FloatToBf16(n[c]);
}

absl::Status CheckFinite(const float* values, int64_t count, const char* what) {
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(what, " value ", i, " is not finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Compress(const CompressorParams& p) {
  KVF_RETURN_IF_ERROR(ValidateCompressorParams(p));
  const CompressorWindows w = CompressorEntries(p.ratio, p.first_position, p.num_rows);
  if (w.count == 0) return absl::OkStatus();
  const int64_t values = p.num_rows * CompressorCoff(p.ratio) * kHeadDim;
  KVF_RETURN_IF_ERROR(CheckFinite(p.kv, values, "kv"));
  if (p.ratio != 1) {
    KVF_RETURN_IF_ERROR(CheckFinite(p.score, values, "score"));
  }
  KVF_RETURN_IF_ERROR(ValidateFinite({p.norm_weight, kHeadDim}));
  KVF_RETURN_IF_ERROR(ValidateLocations({p.entry_locs, static_cast<size_t>(w.count)},
                                        p.geometry.num_tokens(), /*unique=*/true,
                                        "entry location"));
  std::vector<uint16_t> rows(w.count * kHeadDim);
  float pooled[kHeadDim];
  for (int64_t j = 0; j < w.count; ++j) {
    const int64_t end = w.first_end + j * p.ratio;
    PoolWindow(p, end, pooled);
    NormRotate(p, end, pooled, &rows[j * kHeadDim]);
    // The pooled values are bounded by the inputs, but a huge weight can still overflow.
    if (absl::Status s = ValidateFinite({&rows[j * kHeadDim], kHeadDim}, j); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("compressed entry overflowed bf16: ", s.message()));
    }
  }
  if (p.pre_quant_rows != nullptr) std::copy(rows.begin(), rows.end(), p.pre_quant_rows);
  uint8_t fp4_data[kHeadDim / 2], fp4_scale[kHeadDim / 16];
  for (int64_t j = 0; j < w.count; ++j) {
    uint16_t* row = &rows[j * kHeadDim];
    if (p.fp4_fake_quant) {
      QuantizeRow(Layout::kV41Fp4, row, fp4_data, fp4_scale);
      DequantizeRow(Layout::kV41Fp4, fp4_data, fp4_scale, row);
    }
    const RecordOffsets at = LocateRecord(p.geometry, p.entry_locs[j]);
    QuantizeRow(p.geometry.layout, row, p.pool + at.data, p.pool + at.scale);
  }
  return absl::OkStatus();
}

}  // namespace reference
}  // namespace kvferry
