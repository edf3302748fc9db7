// CPU reference of the KV ops: the bit-exact definition the CUDA kernels are held to.
#include "kvferry/kernels/ops.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvferry/kernels/numerics.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/kernels/validate.h"

namespace kvferry::reference {
namespace {

using numerics::Bf16ToFloat;
using numerics::FloatBits;

// Largest |x| of a tile, compared on the magnitude bits (monotonic for finite values).
float TileAmax(const uint16_t* row, int begin, int count) {
  uint32_t amax_bits = 0;
  for (int d = begin; d < begin + count; ++d) {
    const uint32_t bits = (uint32_t{row[d]} << 16) & 0x7FFFFFFFu;
    amax_bits = bits > amax_bits ? bits : amax_bits;
  }
  return numerics::BitsToFloat(amax_bits);
}

}  // namespace

void QuantizeRow(Layout layout, const uint16_t* row, uint8_t* data, uint8_t* scale) {
  const LayoutInfo info = GetLayoutInfo(layout);
  switch (layout) {
    case Layout::kV4:
    case Layout::kV41: {
      const int quantized_dims = layout == Layout::kV4 ? kNopeDim : kHeadDim;
      for (int t = 0; t * info.tile < quantized_dims; ++t) {
        const float amax = TileAmax(row, t * info.tile, info.tile);
        const uint8_t e = layout == Layout::kV4 ? numerics::V4ScaleExponent(amax)
                                                : numerics::V41ScaleExponent(amax);
        const float multiplier = numerics::Ue8m0Reciprocal(e);
        for (int d = t * info.tile; d < (t + 1) * info.tile; ++d) {
          data[d] = numerics::FloatToE4m3(Bf16ToFloat(row[d]) * multiplier);
        }
        scale[t] = e;
      }
      if (layout == Layout::kV4) {
        std::memcpy(data + kNopeDim, row + kNopeDim, kRopeDim * sizeof(uint16_t));
        scale[7] = 0;
      }
      return;
    }
    case Layout::kV41Fp4: {
      for (int t = 0; t < kHeadDim / info.tile; ++t) {
        const uint8_t code = numerics::Fp4ScaleCode(TileAmax(row, t * info.tile, info.tile));
        const float s = numerics::E4m3ToFloat(code);
        for (int d = t * info.tile; d < (t + 1) * info.tile; d += 2) {
          const uint8_t lo = numerics::QuantizeFp4(Bf16ToFloat(row[d]), s);
          const uint8_t hi = numerics::QuantizeFp4(Bf16ToFloat(row[d + 1]), s);
          data[d / 2] = static_cast<uint8_t>(lo | (hi << 4));
        }
        scale[t] = code;
      }
      return;
    }
  }
}

void DequantizeRow(Layout layout, const uint8_t* data, const uint8_t* scale, uint16_t* row) {
  const LayoutInfo info = GetLayoutInfo(layout);
  switch (layout) {
    case Layout::kV4:
    case Layout::kV41: {
      const int quantized_dims = layout == Layout::kV4 ? kNopeDim : kHeadDim;
      for (int d = 0; d < quantized_dims; ++d) {
        const float s = numerics::Ue8m0ToFloat(scale[d / info.tile]);
        row[d] = numerics::FloatToBf16(numerics::E4m3ToFloat(data[d]) * s);
      }
      if (layout == Layout::kV4) {
        std::memcpy(row + kNopeDim, data + kNopeDim, kRopeDim * sizeof(uint16_t));
      }
      return;
    }
    case Layout::kV41Fp4: {
      for (int d = 0; d < kHeadDim; ++d) {
        const float s = numerics::E4m3ToFloat(scale[d / info.tile]);
        const uint8_t nibble = (d & 1) ? (data[d / 2] >> 4) : (data[d / 2] & 0xF);
        row[d] = numerics::FloatToBf16(numerics::E2m1ToFloat(nibble) * s);
      }
      return;
    }
  }
}

absl::Status QuantizeStore(const PoolGeometry& geometry, std::span<const uint16_t> rows,
                           std::span<const int64_t> locs, std::span<uint8_t> pool) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(geometry));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(pool.size(), geometry.pool_bytes(), "pool"));
  KVF_RETURN_IF_ERROR(ValidateRowShape(static_cast<int64_t>(rows.size()),
                                       static_cast<int64_t>(locs.size())));
  KVF_RETURN_IF_ERROR(ValidateFinite(rows));
  KVF_RETURN_IF_ERROR(ValidateLocations(locs, geometry.num_tokens(), /*unique=*/true));
  for (size_t i = 0; i < locs.size(); ++i) {
    const RecordOffsets at = LocateRecord(geometry, locs[i]);
    QuantizeRow(geometry.layout, rows.data() + i * kHeadDim, pool.data() + at.data,
                pool.data() + at.scale);
  }
  return absl::OkStatus();
}

absl::Status DequantizeGather(const PoolGeometry& geometry, std::span<const uint8_t> pool,
                              std::span<const int64_t> locs, std::span<uint16_t> out,
                              int64_t out_row_stride) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(geometry));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(pool.size(), geometry.pool_bytes(), "pool"));
  const int64_t n = static_cast<int64_t>(locs.size());
  KVF_RETURN_IF_ERROR(ValidateWorkspace(n, out.size(), out_row_stride));
  KVF_RETURN_IF_ERROR(ValidateLocations(locs, geometry.num_tokens(), /*unique=*/false));
  for (int64_t i = 0; i < n; ++i) {
    const RecordOffsets at = LocateRecord(geometry, locs[i]);
    DequantizeRow(geometry.layout, pool.data() + at.data, pool.data() + at.scale,
                  out.data() + i * out_row_stride);
  }
  return absl::OkStatus();
}

absl::Status Transcode(const PoolGeometry& from, std::span<const uint8_t> src,
                       const PoolGeometry& to, std::span<uint8_t> dst,
                       std::span<const int64_t> locs) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(from));
  KVF_RETURN_IF_ERROR(ValidateGeometry(to));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(src.size(), from.pool_bytes(), "source pool"));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(dst.size(), to.pool_bytes(), "destination pool"));
  const int64_t limit = std::min(from.num_tokens(), to.num_tokens());
  KVF_RETURN_IF_ERROR(ValidateLocations(locs, limit, /*unique=*/true));
  uint16_t row[kHeadDim];
  for (const int64_t loc : locs) {
    const RecordOffsets in = LocateRecord(from, loc);
    const RecordOffsets out = LocateRecord(to, loc);
    DequantizeRow(from.layout, src.data() + in.data, src.data() + in.scale, row);
    QuantizeRow(to.layout, row, dst.data() + out.data, dst.data() + out.scale);
  }
  return absl::OkStatus();
}

absl::Status GatherPages(const PageCopyGeometry& geometry, std::span<const uint8_t> pool,
                         std::span<const int64_t> pages, std::span<uint8_t> buffer) {
  KVF_RETURN_IF_ERROR(ValidatePageCopy(geometry, pool.size(), pages, buffer.size(), false));
  const int64_t layer_bytes = geometry.num_pages * geometry.page_bytes;
  uint8_t* out = buffer.data();
  for (const int64_t page : pages) {
    for (int layer = 0; layer < geometry.num_layers; ++layer) {
      std::memcpy(out, pool.data() + layer * layer_bytes + page * geometry.page_bytes,
                  geometry.page_bytes);
      out += geometry.page_bytes;
    }
  }
  return absl::OkStatus();
}

absl::Status ScatterPages(const PageCopyGeometry& geometry, std::span<const uint8_t> buffer,
                          std::span<const int64_t> pages, std::span<uint8_t> pool) {
  KVF_RETURN_IF_ERROR(ValidatePageCopy(geometry, pool.size(), pages, buffer.size(), true));
  const int64_t layer_bytes = geometry.num_pages * geometry.page_bytes;
  const uint8_t* in = buffer.data();
  for (const int64_t page : pages) {
    for (int layer = 0; layer < geometry.num_layers; ++layer) {
      std::memcpy(pool.data() + layer * layer_bytes + page * geometry.page_bytes, in,
                  geometry.page_bytes);
      in += geometry.page_bytes;
    }
  }
  return absl::OkStatus();
}

absl::Status ZeroPages(const PageCopyGeometry& geometry, std::span<const int64_t> pages,
                       std::span<uint8_t> pool) {
  KVF_RETURN_IF_ERROR(ValidatePageCopyGeometry(geometry));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(pool.size(), geometry.pool_bytes(), "pool"));
  KVF_RETURN_IF_ERROR(ValidateLocations(pages, geometry.num_pages, /*unique=*/false, "page"));
  const int64_t layer_bytes = geometry.num_pages * geometry.page_bytes;
  for (const int64_t page : pages) {
    for (int layer = 0; layer < geometry.num_layers; ++layer) {
      std::memset(pool.data() + layer * layer_bytes + page * geometry.page_bytes, 0,
                  geometry.page_bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvferry::reference
