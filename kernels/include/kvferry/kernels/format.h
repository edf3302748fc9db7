// The three paged KV layouts (V4, V41, V41_FP4) and their page addressing; host and device.
//
// This header is the single definition of the byte formats of spec/kv-formats.md. It is
// usable from host C++ and from CUDA device code, has no dependencies, and allocates
// nothing. Everything is constexpr or inline so kernels and the CPU reference compute
// addresses the same way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#if defined(__CUDACC__)
#define KVF_HD __host__ __device__ __forceinline__
#else
#define KVF_HD inline
#endif

namespace kvferry {

// Values per token row (the MLA latent): dims 0..447 NoPE, 448..511 RoPE.
inline constexpr int kHeadDim = 512;
inline constexpr int kNopeDim = 448;
inline constexpr int kRopeDim = kHeadDim - kNopeDim;
// bf16 input row, and the baseline every saving is measured against.
inline constexpr int kBf16RowBytes = kHeadDim * 2;

// Page sizes are powers of two in [1, kMaxPageSize].
inline constexpr int kMaxPageSize = 4096;
inline constexpr int kMaxLog2PageSize = 12;

// Wire and storage identifiers: the numeric values are stable (used in files and the API).
enum class Layout : uint8_t {
  kV4 = 0,      // 448 e4m3 + 64 bf16, 7 ue8m0 scales (+1 pad): 584 B/token
  kV41 = 1,     // 512 e4m3, 16 ue8m0 scales: 528 B/token
  kV41Fp4 = 2,  // 512 e2m1 packed, 32 e4m3 scales: 288 B/token
};
inline constexpr int kNumLayouts = 3;

// The per-token record of one layout.
struct LayoutInfo {
  int data_bytes;   // data row per token
  int scale_bytes;  // scale row per token
  int tile;         // values per scale
  int align;        // page bytes are a multiple of this (the reader's row stride)
  KVF_HD constexpr int bytes_per_token() const { return data_bytes + scale_bytes; }
};

KVF_HD constexpr LayoutInfo GetLayoutInfo(Layout layout) {
  switch (layout) {
    case Layout::kV4:
      return LayoutInfo{kNopeDim + kRopeDim * 2, 8, 64, 576};
    case Layout::kV41:
      return LayoutInfo{kHeadDim, kHeadDim / 32, 32, 512};
    case Layout::kV41Fp4:
      return LayoutInfo{kHeadDim / 2, kHeadDim / 16, 16, 256};
  }
  return LayoutInfo{0, 0, 1, 1};
}

KVF_HD constexpr bool IsValidLayout(int layout) { return layout >= 0 && layout < kNumLayouts; }

KVF_HD constexpr bool IsValidPageSize(int64_t page_size) {
  return page_size >= 1 && page_size <= kMaxPageSize && (page_size & (page_size - 1)) == 0;
}

KVF_HD constexpr int Log2PageSize(int page_size) {
  int log2 = 0;
  while ((1 << log2) < page_size) ++log2;
  return log2;
}

// Bytes of one page: all data rows, then all scale rows, zero-padded to the align.
KVF_HD constexpr int64_t PageBytes(Layout layout, int page_size) {
  const LayoutInfo info = GetLayoutInfo(layout);
  const int64_t raw = int64_t{page_size} * info.bytes_per_token();
  return (raw + info.align - 1) / info.align * info.align;
}

// Offset of the scale rows within a page.
KVF_HD constexpr int64_t ScaleOffset(Layout layout, int page_size) {
  return int64_t{page_size} * GetLayoutInfo(layout).data_bytes;
}

// The shape of one layer's pool: `num_pages` pages of `page_size` tokens.
struct PoolGeometry {
  Layout layout = Layout::kV4;
  int page_size = 64;
  int64_t num_pages = 0;

  KVF_HD constexpr int64_t page_bytes() const { return PageBytes(layout, page_size); }
  KVF_HD constexpr int64_t pool_bytes() const { return num_pages * page_bytes(); }
  KVF_HD constexpr int64_t num_tokens() const { return num_pages * page_size; }
};

// Where a token location's record lives, as byte offsets from the pool base.
struct RecordOffsets {
  int64_t data;
  int64_t scale;
};

// token loc = page * page_size + slot. The caller checks 0 <= loc < num_tokens().
KVF_HD constexpr RecordOffsets LocateRecord(const PoolGeometry& geometry, int64_t loc) {
  const LayoutInfo info = GetLayoutInfo(geometry.layout);
  const int64_t page = loc / geometry.page_size;
  const int64_t slot = loc - page * geometry.page_size;
  const int64_t page_base = page * geometry.page_bytes();
  return RecordOffsets{page_base + slot * info.data_bytes,
                       page_base + ScaleOffset(geometry.layout, geometry.page_size) +
                           slot * info.scale_bytes};
}

// Byte accounting (spec §7). Nominal counts the record alone; effective includes page
// padding (page_bytes / page_size). Savings are fractions of the baseline's bytes.
struct Savings {
  double nominal_bytes_per_token;
  double effective_bytes_per_token;
  double nominal_saved_vs_bf16;    // 1 - nominal / 1024
  double nominal_saved_vs_v4;      // 1 - nominal / 584
  double effective_saved_vs_bf16;  // 1 - effective / 1024
  double effective_saved_vs_v4;    // 1 - effective / V4's effective at the same page size
};

inline Savings ComputeSavings(Layout layout, int page_size) {
  const double nominal = GetLayoutInfo(layout).bytes_per_token();
  const double effective = static_cast<double>(PageBytes(layout, page_size)) / page_size;
  const double v4_nominal = GetLayoutInfo(Layout::kV4).bytes_per_token();
  const double v4_effective = static_cast<double>(PageBytes(Layout::kV4, page_size)) / page_size;
  return Savings{nominal,
                 effective,
                 1.0 - nominal / kBf16RowBytes,
                 1.0 - nominal / v4_nominal,
                 1.0 - effective / kBf16RowBytes,
                 1.0 - effective / v4_effective};
}

inline const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kV4:
      return "v4";
    case Layout::kV41:
      return "v41";
    case Layout::kV41Fp4:
      return "v41_fp4";
  }
  return "unknown";
}

// Parses "v4", "v41" or "v41_fp4" (the names LayoutName returns).
inline bool ParseLayoutName(std::string_view name, Layout* layout) {
  for (int i = 0; i < kNumLayouts; ++i) {
    if (name == LayoutName(static_cast<Layout>(i))) {
      *layout = static_cast<Layout>(i);
      return true;
    }
  }
  return false;
}

}  // namespace kvferry
