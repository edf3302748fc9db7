// The cpu fast path's row kernels in Highway: one copy per instruction set, the best one
// the CPU supports chosen at run time.
//
// Every kernel is integer arithmetic on the bf16 bits (or a table derived from the scalar
// rules), so each target computes the reference's bytes without depending on floating-point
// state; cpu_ops_test proves it value by value on every target compiled in.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/fp4_tables.h"
#include "cpu/row_kernels.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/numerics.h"
#include "kvferry/kernels/ops.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/row_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kvferry::cpu::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Token location -> record offsets by shift and mask (page sizes are powers of two):
// LocateRecord's 64-bit division per row costs as much as quantizing a tile.
struct Addressing {
  explicit Addressing(const PoolGeometry& g)
      : shift(Log2PageSize(g.page_size)),
        slot_mask(g.page_size - 1),
        page_bytes(g.page_bytes()),
        scale_offset(ScaleOffset(g.layout, g.page_size)),
        data_bytes(GetLayoutInfo(g.layout).data_bytes),
        scale_bytes(GetLayoutInfo(g.layout).scale_bytes) {}

  RecordOffsets operator()(int64_t loc) const {
    const int64_t base = (loc >> shift) * page_bytes;
    const int64_t slot = loc & slot_mask;
    return RecordOffsets{base + slot * data_bytes, base + scale_offset + slot * scale_bytes};
  }

  int shift;
  int64_t slot_mask, page_bytes, scale_offset, data_bytes, scale_bytes;
};

// Ahead of the row being coded, the record `kPrefetchRows` rows on is requested: scattered
// locations defeat the hardware prefetcher, and a record spans several cache lines.
constexpr int64_t kPrefetchRows = 4;

HWY_INLINE void PrefetchRecord(const uint8_t* data, int data_bytes, const uint8_t* scale,
                               bool for_write) {
  for (int b = 0; b < data_bytes; b += 64) {
    if (for_write) {
      __builtin_prefetch(data + b, 1);
    } else {
      __builtin_prefetch(data + b, 0);
    }
  }
  if (for_write) {
    __builtin_prefetch(scale, 1);
  } else {
    __builtin_prefetch(scale, 0);
  }
}

// Copies `bytes` from a scratch record in L1 to dst, the whole 64-byte lines of dst with
// non-temporal stores: a line written whole need not be read into the cache first, which
// saves a DRAM read per written byte when the output is far larger than the caches. The
// partial lines at either end (dst need not be aligned) take ordinary stores.
HWY_INLINE void StreamCopy(const uint8_t* src, uint8_t* dst, int bytes) {
  const hn::CappedTag<uint8_t, 64> d;
  const int n = static_cast<int>(hn::Lanes(d));
  const int head = static_cast<int>((64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  if (head >= bytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
  std::memcpy(dst, src, head);
  int i = head;
  for (; i + 64 <= bytes; i += 64) {
    for (int j = 0; j < 64; j += n) hn::Stream(hn::LoadU(d, src + i + j), d, dst + i + j);
  }
  std::memcpy(dst + i, src + i, bytes - i);
}

// bf16 magnitudes at or above this are NaN or Inf.
constexpr int kNonFiniteMagnitude = 0x7F80;

#if HWY_TARGET == HWY_SCALAR

// One-lane vectors gain nothing over the reference's loops, so this target runs them.
bool ScaleRow(Layout layout, const uint16_t* row, uint8_t* scale, const Fp4Tables&) {
  uint8_t data[kHeadDim * 2];
  reference::QuantizeRow(layout, row, data, scale);
  return std::none_of(row, row + kHeadDim, numerics::Bf16IsNonFinite);
}
void EncodeRow(Layout layout, const uint16_t* row, const uint8_t*, uint8_t* data,
               const Fp4Tables&) {
  uint8_t scale[kHeadDim / 16];
  reference::QuantizeRow(layout, row, data, scale);
}
void DequantizeRow(Layout layout, const uint8_t* data, const uint8_t* scale, uint16_t* row,
                   const Fp4Tables&) {
  reference::DequantizeRow(layout, data, scale, row);
}

#else

// 16-bit lanes, at most 256 bits: a V41_FP4 tile is 16 values and a vector must not straddle
// two tiles. Every tile (16, 32, 64 values) is a whole number of vectors on every target.
using D16 = hn::CappedTag<int16_t, 16>;
using V16 = hn::Vec<D16>;

HWY_INLINE V16 LoadBf16(D16 d, const uint16_t* p) {
  return hn::LoadU(d, reinterpret_cast<const int16_t*>(p));
}

// Largest magnitude bits (bf16 & 0x7FFF) of `count` values, a multiple of the lane count.
// The last step reduces 8 unsigned lanes of 128 bits, where x86 has a one-instruction
// horizontal minimum (Highway's MaxOfLanes uses it): a quarter of the cost of reducing 256
// bits, and a V41_FP4 row has 32 tiles to reduce.
HWY_INLINE int TileAmax(D16 d, const uint16_t* p, int count) {
  const int n = static_cast<int>(hn::Lanes(d));
  const V16 magnitude = hn::Set(d, 0x7FFF);
  V16 max = hn::And(LoadBf16(d, p), magnitude);
  for (int i = n; i < count; i += n) max = hn::Max(max, hn::And(LoadBf16(d, p + i), magnitude));
  if constexpr (hn::MaxLanes(D16()) > 8) {
    const hn::Half<D16> dh;
    const hn::RebindToUnsigned<decltype(dh)> du;
    const auto half = hn::Max(hn::LowerHalf(dh, max), hn::UpperHalf(dh, max));
    return hn::GetLane(hn::MaxOfLanes(du, hn::BitCast(du, half)));
  } else {
    const hn::RebindToUnsigned<D16> du;
    return hn::GetLane(hn::MaxOfLanes(du, hn::BitCast(du, max)));
  }
}

using DU16 = hn::RebindToUnsigned<D16>;
using VU16 = hn::Vec<DU16>;

// e4m3 RNE-sat(x * 2^(127-e)) without forming the product, from the magnitude bits
// a = Ex << 7 | m7 of a finite bf16 x: with c = (e - 7) << 7, t = a - c = E' << 7 | m7 where
// E' is the e4m3 biased exponent of the product (exact: a power of two only moves the
// exponent). This is numerics::FloatToE4m3 on the bits, in two parts. A finite row's e is
// in [105, 247] (V4's floor to bf16's maximum), so every constant and t fit in 16 bits.
//
// EncodeE4m3Normal is exact for every lane except those with E' in [-3, 0] (t in
// [-384, 128), the e4m3 subnormals): for E' >= 1 it keeps 3 of the 7 mantissa bits rounding
// to nearest even (a carry rolls into the exponent) and saturates at 0x7E = 448; below
// E' = -3 the product is under half the smallest step and the code is 0. It works on
// tb = max(t + 7, 0), one saturating subtraction: (tb + bit 4 of tb) >> 4 is t rounded to
// nearest even in units of 16 (when t's low bits exceed 8, tb has already carried and the
// extra bit cannot carry again).
HWY_INLINE VU16 EncodeE4m3Normal(DU16 du, VU16 a, int e) {
  const VU16 tb = hn::SaturatedSub(a, hn::Set(du, static_cast<uint16_t>((e - 7) * 128 - 7)));
  const VU16 odd = hn::And(hn::ShiftRight<4>(tb), hn::Set(du, 1));
  return hn::Min(hn::ShiftRight<4>(hn::Add(tb, odd)), hn::Set(du, 0x7E));
}

// Zero in the lanes EncodeE4m3Normal may get wrong (t in [-384, 128)), nonzero elsewhere.
HWY_INLINE VU16 OutsideSubnormalRange(DU16 du, VU16 a, int e) {
  return hn::ShiftRight<9>(hn::Sub(a, hn::Set(du, static_cast<uint16_t>((e - 10) * 128))));
}

// `code` with the lanes of t in [-384, 128) recoded exactly: (128 | m7) >> (5 - E') rounded
// to nearest even, the variable shift done as << (E' + 3), then >> 8 in every lane.
HWY_INLINE VU16 FixE4m3Subnormals(DU16 du, VU16 a, int e, VU16 code) {
  const D16 d;
  const V16 t = hn::Sub(hn::BitCast(d, a), hn::Set(d, static_cast<int16_t>((e - 7) * 128)));
  const V16 exponent = hn::ShiftRight<7>(t);  // arithmetic: floor(t / 128) = E'
  V16 significand = hn::Or(hn::And(t, hn::Set(d, 0x7F)), hn::Set(d, 0x80));
  for (int at_least = -2; at_least <= 0; ++at_least) {
    significand = hn::IfThenElse(exponent > hn::Set(d, static_cast<int16_t>(at_least - 1)),
                                 hn::Add(significand, significand), significand);
  }
  const V16 odd = hn::And(hn::ShiftRight<8>(significand), hn::Set(d, 1));
  const V16 rounded = hn::ShiftRight<8>(hn::Add(hn::Add(significand, hn::Set(d, 127)), odd));
  return hn::IfThenElse(OutsideSubnormalRange(du, a, e) == hn::Zero(du),
                        hn::BitCast(du, rounded), code);
}

// Codes the e4m3 tiles of a row into data, tile t under exponent e[t]; with kExact the
// subnormal fix is applied, without it the result says whether the row needed none.
template <int kTile, int kTiles, bool kExact>
HWY_INLINE bool CodeE4m3Tiles(const uint16_t* row, uint8_t* data, const uint8_t* e) {
  const D16 d;
  const DU16 du;
  const hn::Rebind<uint8_t, D16> d8;
  const int n = static_cast<int>(hn::Lanes(d));
  const VU16 magnitude = hn::Set(du, 0x7FFF), sign = hn::Set(du, 0x80);
  VU16 nearest = hn::Set(du, 0xFFFF);
  for (int t = 0; t < kTiles; ++t) {
    for (int i = t * kTile; i < (t + 1) * kTile; i += n) {
      const VU16 bits = hn::LoadU(du, row + i);
      const VU16 a = hn::And(bits, magnitude);
      VU16 code = EncodeE4m3Normal(du, a, e[t]);
      if constexpr (kExact) {
        code = FixE4m3Subnormals(du, a, e[t], code);
      } else {
        nearest = hn::Min(nearest, OutsideSubnormalRange(du, a, e[t]));
      }
      code = hn::Or(code, hn::And(hn::ShiftRight<8>(bits), sign));
      hn::StoreU(hn::DemoteTo(d8, hn::BitCast(d, code)), d8, data + i);
    }
  }
  return hn::GetLane(hn::MinOfLanes(du, nearest)) != 0;
}

// The scale row of a row into scale: V4 7 exponents and the zero pad byte, V41 16
// exponents, V41_FP4 32 e4m3 codes. False if the row holds NaN or Inf (all 512 values are
// looked at, V4's RoPE dims too), and the scale row is then meaningless.
template <Layout kLayout>
bool ScaleRowT(const uint16_t* row, uint8_t* scale, const Fp4Tables& tables) {
  constexpr int kTile = GetLayoutInfo(kLayout).tile;
  constexpr int kTiles = (kLayout == Layout::kV4 ? kNopeDim : kHeadDim) / kTile;
  const D16 d;
  int row_max = 0;
  for (int t = 0; t < kTiles; ++t) {
    const int amax = TileAmax(d, row + t * kTile, kTile);
    row_max = std::max(row_max, amax);
    const float amax_value = numerics::BitsToFloat(static_cast<uint32_t>(amax) << 16);
    if constexpr (kLayout == Layout::kV4) {
      scale[t] = numerics::V4ScaleExponent(amax_value);
    } else if constexpr (kLayout == Layout::kV41) {
      scale[t] = numerics::V41ScaleExponent(amax_value);
    } else {
      scale[t] = tables.scale_code[amax];
    }
  }
  if constexpr (kLayout == Layout::kV4) {
    row_max = std::max(row_max, TileAmax(d, row + kNopeDim, kRopeDim));
    scale[7] = 0;
  }
  return row_max < kNonFiniteMagnitude;
}

// V4 (NoPE tiles and the copied RoPE dims) and V41 codes of a finite row under its scale
// row. The sign bit is copied, so -0 and negative values that round to zero give 0x80, as in
// the reference.
template <Layout kLayout>
void EncodeE4m3Row(const uint16_t* row, const uint8_t* scale, uint8_t* data) {
  constexpr int kTile = GetLayoutInfo(kLayout).tile;
  constexpr int kTiles = (kLayout == Layout::kV4 ? kNopeDim : kHeadDim) / kTile;
  // The fix is needed only for values some 2^14 below their tile's amax: rare in real rows,
  // so a row that has any is coded a second time, exactly.
  const bool exact = CodeE4m3Tiles<kTile, kTiles, /*kExact=*/false>(row, data, scale);
  if (HWY_UNLIKELY(!exact)) CodeE4m3Tiles<kTile, kTiles, /*kExact=*/true>(row, data, scale);
  if constexpr (kLayout == Layout::kV4) {
    std::memcpy(data + kNopeDim, row + kNopeDim, kRopeDim * sizeof(uint16_t));
  }
}

// V41_FP4 codes of a finite row under its scale codes, by table (see Fp4Tables): a code is
// the count of thresholds the magnitude exceeds. The sign is kept for every nonzero value
// (|x| / S >= 2^-142 never rounds to zero in fp32) and dropped for -0, as the reference's
// "+ 0.0f" does.
void EncodeFp4Row(const uint16_t* row, const uint8_t* scale, uint8_t* data,
                  const Fp4Tables& tables) {
  constexpr int kTile = 16;
  const D16 d;
  const hn::Repartition<int32_t, D16> d32;
  const hn::Rebind<uint8_t, decltype(d32)> d8;
  const int n = static_cast<int>(hn::Lanes(d));
  const V16 magnitude = hn::Set(d, 0x7FFF);
  const V16 sign_bit = hn::Set(d, static_cast<int16_t>(0x8000));
  const V16 sign = hn::Set(d, 0x8);
  for (int t = 0; t < kHeadDim / kTile; ++t) {
    const int16_t* thresholds = tables.thresholds[scale[t]];
    for (int i = t * kTile; i < (t + 1) * kTile; i += n) {
      const V16 bits = LoadBf16(d, row + i);
      const V16 a = hn::And(bits, magnitude);
      // Each exceeded threshold is a -1 lane; summed as a tree, not a chain of 7.
      auto above = [&](int k) HWY_ATTR {
        return hn::VecFromMask(d, a > hn::Set(d, thresholds[k]));
      };
      const V16 minus_code =
          hn::Add(hn::Add(hn::Add(above(0), above(1)), hn::Add(above(2), above(3))),
                  hn::Add(hn::Add(above(4), above(5)), above(6)));
      // Negative and nonzero: bits above 0x8000, i.e. bits ^ 0x8000 above 0 as int16.
      const V16 negative = hn::VecFromMask(d, hn::Xor(bits, sign_bit) > hn::Zero(d));
      const V16 code = hn::Or(hn::Neg(minus_code), hn::And(negative, sign));
      // Two codes per 32-bit lane (dim 2j low, 2j+1 high) -> one byte: low | high << 4.
      auto pairs = hn::BitCast(d32, code);
      pairs = hn::And(hn::Or(pairs, hn::ShiftRight<12>(pairs)), hn::Set(d32, 0xFF));
      hn::StoreU(hn::DemoteTo(d8, pairs), d8, data + i / 2);
    }
  }
}

// bf16 bits of the e4m3 subnormal magnitudes m * 2^-9 (m = 0..7) before scaling by 2^9:
// the bf16 of m, as little-endian bytes for an in-register lookup.
alignas(16) constexpr uint8_t kSubnormalBf16[16] = {0x00, 0x00, 0x80, 0x3F, 0x00, 0x40,
                                                     0x40, 0x40, 0x80, 0x40, 0xA0, 0x40,
                                                     0xC0, 0x40, 0xE0, 0x40};

// Scale bytes for which every code's product is a normal bf16 (exponent field 1..254), so
// the bit arithmetic below is exact; other bytes (a store writes them only for tiles whose
// amax is within a factor 2 of bf16's maximum) take the reference's path.
constexpr int kMinArithmeticScale = 10;
constexpr int kMaxArithmeticScale = 246;

// Whether any of `count` e4m3 codes (a multiple of 32) is a subnormal (magnitude 1..7).
HWY_INLINE bool HasSubnormalCodes(const uint8_t* codes, int count) {
  const hn::CappedTag<int8_t, 32> d;
  const int n = static_cast<int>(hn::Lanes(d));
  const auto low7 = hn::Set(d, 0x7F), eight = hn::Set(d, 8), zero = hn::Zero(d);
  auto found = zero;
  for (int i = 0; i < count; i += n) {
    const auto m = hn::And(hn::LoadU(d, reinterpret_cast<const int8_t*>(codes) + i), low7);
    found = hn::Or(found, hn::VecFromMask(d, hn::And(m > zero, m < eight)));
  }
  return !hn::AllTrue(d, found == zero);
}

// V4 (NoPE) and V41 bf16 values of a row's codes, tile t under exponent scale[t]: the
// product e4m3(code) * 2^(e-127) is exact, so its bf16 is assembled from bits. A normal
// code's (exponent, mantissa) lands at (code & 0x7F) << 4 plus (e - 7) << 7; with
// kSubnormals a subnormal code m becomes bf16(m) * 2^(e - 136) (an in-register lookup),
// without it the row must have none.
template <int kTile, int kTiles, bool kSubnormals>
HWY_INLINE void DecodeE4m3Tiles(const uint8_t* data, const uint8_t* scale, uint16_t* row) {
  const D16 d;
  const hn::Rebind<uint8_t, D16> d8;
  const hn::Repartition<uint8_t, D16> dbytes;
  const int n = static_cast<int>(hn::Lanes(d));
  const auto table = hn::LoadDup128(dbytes, kSubnormalBf16);
  const V16 low7 = hn::Set(d, 0x7F), low3 = hn::Set(d, 0x7), eight = hn::Set(d, 8);
  const V16 zero = hn::Zero(d), sign = hn::Set(d, 0x80);
  // Byte indices 2m, 2m + 1 of entry m.
  const V16 index_step = hn::Set(d, 0x0202), index_base = hn::Set(d, 0x0100);
  int16_t* out = reinterpret_cast<int16_t*>(row);
  for (int t = 0; t < kTiles; ++t) {
    const int e = scale[t];
    const V16 normal_bias = hn::Set(d, static_cast<int16_t>((e - 7) * 128));
    const V16 subnormal_bias = hn::Set(d, static_cast<int16_t>((e - 136) * 128));
    for (int i = t * kTile; i < (t + 1) * kTile; i += n) {
      const V16 code = hn::PromoteTo(d, hn::LoadU(d8, data + i));
      const V16 m = hn::And(code, low7);
      V16 value = hn::IfThenZeroElse(m == zero, hn::Add(hn::ShiftLeft<4>(m), normal_bias));
      if constexpr (kSubnormals) {
        const V16 index = hn::Add(hn::And(m, low3) * index_step, index_base);
        const V16 subnormal = hn::Add(
            hn::BitCast(d, hn::TableLookupBytes(table, hn::BitCast(dbytes, index))),
            subnormal_bias);
        value = hn::IfThenElse(m < eight, hn::IfThenZeroElse(m == zero, subnormal), value);
      }
      value = hn::Or(value, hn::ShiftLeft<8>(hn::And(code, sign)));
      hn::StoreU(value, d, out + i);
    }
  }
}

// V4 (NoPE tiles and the copied RoPE dims) and V41 dequantization of one row. Subnormal
// codes (values below 2^-6 of the scale) are rare in stored rows, so only rows that have
// any pay for the lookup.
template <Layout kLayout>
void DequantizeE4m3Row(const uint8_t* data, const uint8_t* scale, uint16_t* row) {
  constexpr int kTile = GetLayoutInfo(kLayout).tile;
  constexpr int kDims = kLayout == Layout::kV4 ? kNopeDim : kHeadDim;
  constexpr int kTiles = kDims / kTile;
  for (int t = 0; t < kTiles; ++t) {
    if (HWY_UNLIKELY(scale[t] < kMinArithmeticScale || scale[t] > kMaxArithmeticScale)) {
      reference::DequantizeRow(kLayout, data, scale, row);
      return;
    }
  }
  if (HasSubnormalCodes(data, kDims)) {
    DecodeE4m3Tiles<kTile, kTiles, /*kSubnormals=*/true>(data, scale, row);
  } else {
    DecodeE4m3Tiles<kTile, kTiles, /*kSubnormals=*/false>(data, scale, row);
  }
  if constexpr (kLayout == Layout::kV4) {
    std::memcpy(row + kNopeDim, data + kNopeDim, kRopeDim * sizeof(uint16_t));
  }
}

// V41_FP4 dequantization: per 16-value tile, one in-register lookup of the tile's products
// (Fp4Tables::dequant_*), indexed by the 16 nibbles. 128-bit vectors: one tile each.
void DequantizeFp4Row(const uint8_t* data, const uint8_t* scale, uint16_t* row,
                      const Fp4Tables& tables) {
  const hn::FixedTag<uint8_t, 16> d8;
  const hn::FixedTag<uint8_t, 8> dpacked;
  const hn::FixedTag<uint16_t, 8> d16;
  const auto low4 = hn::Set(d16, 0xF);
  for (int t = 0; t < kHeadDim / 16; ++t) {
    const auto packed = hn::PromoteTo(d16, hn::LoadU(dpacked, data + 8 * t));
    // Byte 2j indexes dim 2j (low nibble), byte 2j + 1 dim 2j + 1 (high nibble).
    const auto index =
        hn::BitCast(d8, hn::Or(hn::And(packed, low4), hn::ShiftLeft<8>(hn::ShiftRight<4>(packed))));
    const auto low = hn::TableLookupBytes(hn::Load(d8, tables.dequant_low[scale[t]]), index);
    const auto high = hn::TableLookupBytes(hn::Load(d8, tables.dequant_high[scale[t]]), index);
    hn::StoreU(hn::ZipLower(d16, low, high), d16, row + 16 * t);
    hn::StoreU(hn::ZipUpper(d16, low, high), d16, row + 16 * t + 8);
  }
}

// Calls fn with the layout as a compile-time constant: the one place a runtime layout picks
// the row kernels.
template <typename Fn>
HWY_INLINE decltype(auto) WithLayout(Layout layout, const Fn& fn) {
  switch (layout) {
    case Layout::kV4:
      return fn(std::integral_constant<Layout, Layout::kV4>());
    case Layout::kV41:
      return fn(std::integral_constant<Layout, Layout::kV41>());
    case Layout::kV41Fp4:
      break;
  }
  return fn(std::integral_constant<Layout, Layout::kV41Fp4>());
}

bool ScaleRow(Layout layout, const uint16_t* row, uint8_t* scale, const Fp4Tables& tables) {
  return WithLayout(layout, [&](auto l) HWY_ATTR { return ScaleRowT<l()>(row, scale, tables); });
}

void EncodeRow(Layout layout, const uint16_t* row, const uint8_t* scale, uint8_t* data,
               const Fp4Tables& tables) {
  WithLayout(layout, [&](auto l) HWY_ATTR {
    if constexpr (l() == Layout::kV41Fp4) {
      EncodeFp4Row(row, scale, data, tables);
    } else {
      EncodeE4m3Row<l()>(row, scale, data);
    }
  });
}

void DequantizeRow(Layout layout, const uint8_t* data, const uint8_t* scale, uint16_t* row,
                   const Fp4Tables& tables) {
  WithLayout(layout, [&](auto l) HWY_ATTR {
    if constexpr (l() == Layout::kV41Fp4) {
      DequantizeFp4Row(data, scale, row, tables);
    } else {
      DequantizeE4m3Row<l()>(data, scale, row);
    }
  });
}

#endif  // HWY_TARGET == HWY_SCALAR

int64_t TargetImpl() { return HWY_TARGET; }

// A row into its record: the reference's rules for a row with NaN or Inf (only a transcode
// of a corrupt record meets one).
void QuantizeRow(Layout layout, const uint16_t* row, uint8_t* data, uint8_t* scale,
                 const Fp4Tables& tables) {
  alignas(32) uint8_t scale_row[kHeadDim / 16];
  if (HWY_UNLIKELY(!ScaleRow(layout, row, scale_row, tables))) {
    reference::QuantizeRow(layout, row, data, scale);
    return;
  }
  EncodeRow(layout, row, scale_row, data, tables);
  std::memcpy(scale, scale_row, GetLayoutInfo(layout).scale_bytes);
}

bool ScaleRowsImpl(Layout layout, const uint16_t* rows, int64_t count, uint8_t* scales) {
  const Fp4Tables& tables = Fp4Tables::Get();
  const int scale_bytes = GetLayoutInfo(layout).scale_bytes;
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) {
    finite &= ScaleRow(layout, rows + i * kHeadDim, scales + i * scale_bytes, tables);
  }
  return finite;
}

void EncodeRowsImpl(const PoolGeometry& geometry, const uint16_t* rows, const uint8_t* scales,
                    const int64_t* locs, int64_t count, uint8_t* pool, bool stream) {
  const Addressing locate(geometry);
  const Fp4Tables& tables = Fp4Tables::Get();
  const int data_bytes = static_cast<int>(locate.data_bytes);
  const int scale_bytes = static_cast<int>(locate.scale_bytes);
  for (int64_t i = 0; i < count; ++i) {
    if (i + kPrefetchRows < count) {
      const RecordOffsets ahead = locate(locs[i + kPrefetchRows]);
      PrefetchRecord(pool + ahead.data, data_bytes, pool + ahead.scale, /*for_write=*/true);
    }
    const RecordOffsets at = locate(locs[i]);
    const uint8_t* scale = scales + i * scale_bytes;
    if (stream) {
      alignas(64) uint8_t data[kNopeDim + kRopeDim * 2];
      EncodeRow(geometry.layout, rows + i * kHeadDim, scale, data, tables);
      StreamCopy(data, pool + at.data, data_bytes);
    } else {
      EncodeRow(geometry.layout, rows + i * kHeadDim, scale, pool + at.data, tables);
    }
    std::memcpy(pool + at.scale, scale, scale_bytes);
  }
  if (stream) hwy::FlushStream();  // order the streamed lines before the caller's sync
}

void DequantizeRowsImpl(const PoolGeometry& geometry, const uint8_t* pool, const int64_t* locs,
                        int64_t count, uint16_t* out, int64_t out_row_stride, bool stream) {
  const Addressing locate(geometry);
  const Fp4Tables& tables = Fp4Tables::Get();
  const int data_bytes = static_cast<int>(locate.data_bytes);
  for (int64_t i = 0; i < count; ++i) {
    if (i + kPrefetchRows < count) {
      const RecordOffsets ahead = locate(locs[i + kPrefetchRows]);
      PrefetchRecord(pool + ahead.data, data_bytes, pool + ahead.scale, /*for_write=*/false);
    }
    const RecordOffsets at = locate(locs[i]);
    uint16_t* row = out + i * out_row_stride;
    if (stream) {
      alignas(64) uint16_t scratch[kHeadDim];
      DequantizeRow(geometry.layout, pool + at.data, pool + at.scale, scratch, tables);
      StreamCopy(reinterpret_cast<const uint8_t*>(scratch), reinterpret_cast<uint8_t*>(row),
                 kBf16RowBytes);
    } else {
      DequantizeRow(geometry.layout, pool + at.data, pool + at.scale, row, tables);
    }
  }
  if (stream) hwy::FlushStream();
}

void TranscodeRowsImpl(const PoolGeometry& from, const uint8_t* src, const PoolGeometry& to,
                       uint8_t* dst, const int64_t* locs, int64_t count) {
  const Addressing locate_from(from), locate_to(to);
  const Fp4Tables& tables = Fp4Tables::Get();
  alignas(64) uint16_t row[kHeadDim];
  for (int64_t i = 0; i < count; ++i) {
    const RecordOffsets in = locate_from(locs[i]);
    const RecordOffsets out = locate_to(locs[i]);
    DequantizeRow(from.layout, src + in.data, src + in.scale, row, tables);
    QuantizeRow(to.layout, row, dst + out.data, dst + out.scale, tables);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kvferry::cpu::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvferry::cpu::internal {

HWY_EXPORT(TargetImpl);
HWY_EXPORT(ScaleRowsImpl);
HWY_EXPORT(EncodeRowsImpl);
HWY_EXPORT(DequantizeRowsImpl);
HWY_EXPORT(TranscodeRowsImpl);

const char* DispatchedTargetName() {
  return hwy::TargetName(HWY_DYNAMIC_DISPATCH(TargetImpl)());
}

bool ScaleRows(Layout layout, const uint16_t* rows, int64_t count, uint8_t* scales) {
  return HWY_DYNAMIC_DISPATCH(ScaleRowsImpl)(layout, rows, count, scales);
}

void EncodeRows(const PoolGeometry& geometry, const uint16_t* rows, const uint8_t* scales,
                const int64_t* locs, int64_t count, uint8_t* pool, bool stream) {
  HWY_DYNAMIC_DISPATCH(EncodeRowsImpl)(geometry, rows, scales, locs, count, pool, stream);
}

void DequantizeRows(const PoolGeometry& geometry, const uint8_t* pool, const int64_t* locs,
                    int64_t count, uint16_t* out, int64_t out_row_stride, bool stream) {
  HWY_DYNAMIC_DISPATCH(DequantizeRowsImpl)(geometry, pool, locs, count, out, out_row_stride,
                                           stream);
}

void TranscodeRows(const PoolGeometry& from, const uint8_t* src, const PoolGeometry& to,
                   uint8_t* dst, const int64_t* locs, int64_t count) {
  HWY_DYNAMIC_DISPATCH(TranscodeRowsImpl)(from, src, to, dst, locs, count);
}

}  // namespace kvferry::cpu::internal
#endif  // HWY_ONCE
