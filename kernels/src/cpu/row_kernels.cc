// The cpu fast path's row kernels in Highway: one copy per instruction set, the best one
// the CPU supports chosen at run time.
//
// Every kernel is integer arithmetic on the bf16 bits (or a table derived from the scalar
// rules), so each target computes the reference's bytes without depending on floating-point
// state; cpu_ops_test proves it value by value on every target compiled in.
#include <algorithm>
#include <array>
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

// The lines [from, to) of a bf16 row requested into L2 (the row is read a block later).
// The coders that can spread these requests over their steps do (a row's 16 at once held
// the core's fill buffers while the coding went on: bench/RESULTS.md); the others take
// them all before the row.
HWY_INLINE void RequestRowLines(const char* row, int from, int to) {
  for (int line = from; line < to; ++line) __builtin_prefetch(row + line * 64, 0, 1);
}

// Streams a contiguous output region written front to back in pieces of any length: every
// 64-byte line wholly inside the region is written once, whole, with non-temporal stores (a
// line written whole need not be read into the cache first, which saves a DRAM read per
// written byte when the output is far larger than the caches), the part of a piece that
// ends inside a line waiting in `pending_` for the next piece. Only the region's first and
// last lines, where the region covers them in part, take ordinary stores of the region's
// own bytes (the rest of such a line may be another writer's), which read the line from
// DRAM first: streaming each row of a gather as a region of its own into a workspace not
// aligned to 64 bytes ran at 43-54 % of the copy instead of 71-79 % (bench/RESULTS.md).
class LineStream {
 public:
  explicit LineStream(uint8_t* begin) : next_(begin), begin_(Address(begin)) {}

  void Append(const uint8_t* src, int64_t bytes) {
    const hn::CappedTag<uint8_t, 64> d;
    const int n = static_cast<int>(hn::Lanes(d));
    int64_t at = 0;
    const int offset = static_cast<int>(Address(next_) % 64);
    if (offset != 0) {
      at = std::min<int64_t>(64 - offset, bytes);
      std::memcpy(pending_ + offset, src, at);
      next_ += at;
      if (offset + at < 64) return;
      const uintptr_t line = Address(next_) - 64;
      if (begin_ > line) {
        // The region's first line, begun inside: only the region's bytes of it.
        const int skip = static_cast<int>(begin_ - line);
        std::memcpy(next_ - (64 - skip), pending_ + skip, 64 - skip);
      } else {
        for (int j = 0; j < 64; j += n) hn::Stream(hn::Load(d, pending_ + j), d, next_ - 64 + j);
      }
    }
    for (; at + 64 <= bytes; at += 64, next_ += 64) {
      for (int j = 0; j < 64; j += n) hn::Stream(hn::LoadU(d, src + at + j), d, next_ + j);
    }
    std::memcpy(pending_, src + at, bytes - at);
    next_ += bytes - at;
  }

  // Writes the region's last line if it ends inside one.
  void Finish() {
    const int offset = static_cast<int>(Address(next_) % 64);
    const uintptr_t line = Address(next_) - offset;
    const int skip = begin_ > line ? static_cast<int>(begin_ - line) : 0;
    if (offset > skip) std::memcpy(next_ - (offset - skip), pending_ + skip, offset - skip);
  }

 private:
  static uintptr_t Address(const uint8_t* p) { return reinterpret_cast<uintptr_t>(p); }

  uint8_t* next_;          // where the next byte goes
  const uintptr_t begin_;  // the region's first byte
  alignas(64) uint8_t pending_[64];  // the line of next_, its bytes before next_
};

// Copies `bytes` from a scratch record in L1 to dst as a region of one piece (LineStream).
HWY_INLINE void StreamCopy(const uint8_t* src, uint8_t* dst, int bytes) {
  LineStream region(dst);
  region.Append(src, bytes);
  region.Finish();
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
               const Fp4Tables&, const char* ahead) {
  if (ahead != nullptr) RequestRowLines(ahead, 0, kBf16RowBytes / 64);
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
//
// The per-tile constants are made once per tile (E4m3Bias), not per vector.
//
// These work on unsigned 16-bit lanes of any width (DU): a tile of 32 or 64 values takes
// 512-bit vectors where the CPU has them, twice the values per instruction of 256 bits.
template <class DU>
struct E4m3Bias {
  E4m3Bias(DU du, int e)
      : normal(hn::Set(du, static_cast<uint16_t>((e - 7) * 128 - 7))),
        subnormal(hn::Set(du, static_cast<uint16_t>((e - 10) * 128))) {}
  hn::Vec<DU> normal;     // (e - 7) * 128 - 7: t + 7 = a - normal
  hn::Vec<DU> subnormal;  // (e - 10) * 128: t + 384 = a - subnormal
};

template <class DU, class V = hn::Vec<DU>>
HWY_INLINE V EncodeE4m3Normal(DU du, V a, const E4m3Bias<DU>& bias) {
  const V tb = hn::SaturatedSub(a, bias.normal);
  const V odd = hn::And(hn::ShiftRight<4>(tb), hn::Set(du, 1));
  return hn::Min(hn::ShiftRight<4>(hn::Add(tb, odd)), hn::Set(du, 0x7E));
}

// Zero in the lanes EncodeE4m3Normal may get wrong (t in [-384, 128)), nonzero elsewhere.
template <class DU, class V = hn::Vec<DU>>
HWY_INLINE V OutsideSubnormalRange(V a, const E4m3Bias<DU>& bias) {
  return hn::ShiftRight<9>(hn::Sub(a, bias.subnormal));
}

// `code` with the lanes of t in [-384, 128) recoded exactly: (128 | m7) >> (5 - E') rounded
// to nearest even, the variable shift done as << (E' + 3), then >> 8 in every lane.
template <class DU, class V = hn::Vec<DU>>
HWY_INLINE V FixE4m3Subnormals(DU du, V a, int e, const E4m3Bias<DU>& bias, V code) {
  const hn::RebindToSigned<DU> d;
  using VS = hn::Vec<decltype(d)>;
  const VS t = hn::Sub(hn::BitCast(d, a), hn::Set(d, static_cast<int16_t>((e - 7) * 128)));
  const VS exponent = hn::ShiftRight<7>(t);  // arithmetic: floor(t / 128) = E'
  VS significand = hn::Or(hn::And(t, hn::Set(d, 0x7F)), hn::Set(d, 0x80));
  for (int at_least = -2; at_least <= 0; ++at_least) {
    significand = hn::IfThenElse(exponent > hn::Set(d, static_cast<int16_t>(at_least - 1)),
                                 hn::Add(significand, significand), significand);
  }
  const VS odd = hn::And(hn::ShiftRight<8>(significand), hn::Set(d, 1));
  const VS rounded = hn::ShiftRight<8>(hn::Add(hn::Add(significand, hn::Set(d, 127)), odd));
  return hn::IfThenElse(OutsideSubnormalRange<DU>(a, bias) == hn::Zero(du),
                        hn::BitCast(du, rounded), code);
}

// The e4m3 coders' and decoders' vectors: 16-bit lanes, up to 512 bits, never more than a
// tile (32 or 64 values), so that one tile's constants serve a whole vector.
template <typename T, int kTile>
using TileTag = hn::CappedTag<T, (kTile < 32 ? kTile : 32)>;

// Codes the e4m3 tiles of a row into data, tile t under exponent e[t]; with kExact the
// subnormal fix is applied, without it the result says whether the row needed none.
template <int kTile, int kTiles, bool kExact>
HWY_INLINE bool CodeE4m3Tiles(const uint16_t* row, uint8_t* data, const uint8_t* e) {
  using DU = TileTag<uint16_t, kTile>;
  using V = hn::Vec<DU>;
  const DU du;
  const hn::RebindToSigned<DU> d;
  const hn::Rebind<uint8_t, DU> d8;
  const int n = static_cast<int>(hn::Lanes(du));
  const V magnitude = hn::Set(du, 0x7FFF), sign = hn::Set(du, 0x80);
  V nearest = hn::Set(du, 0xFFFF);
  // A local copy: the stores into data could alias the scale row, which would make the
  // compiler load it (and remake the constants) again after every vector.
  uint8_t exponents[kTiles];
  std::memcpy(exponents, e, kTiles);
  for (int t = 0; t < kTiles; ++t) {
    const E4m3Bias<DU> bias(du, exponents[t]);
    for (int i = t * kTile; i < (t + 1) * kTile; i += n) {
      const V bits = hn::LoadU(du, row + i);
      const V a = hn::And(bits, magnitude);
      V code = EncodeE4m3Normal(du, a, bias);
      if constexpr (kExact) {
        code = FixE4m3Subnormals(du, a, exponents[t], bias, code);
      } else {
        // OutsideSubnormalRange's difference, shifted once for all lanes at the end.
        nearest = hn::Min(nearest, hn::Sub(a, bias.subnormal));
      }
      code = hn::OrAnd(code, hn::ShiftRight<8>(bits), sign);  // one ternary op on AVX-512
      hn::StoreU(hn::DemoteTo(d8, hn::BitCast(d, code)), d8, data + i);
    }
  }
  return (hn::GetLane(hn::MinOfLanes(du, nearest)) >> 9) != 0;
}

#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL
// CodeE4m3Tiles<..., kExact = false> where AVX-512 has VBMI, 64 values a step, their 64
// codes in one store. On Intel cores only port 0 runs 512-bit shifts,
// saturating subtractions and minima, and only port 5 shuffles; CodeE4m3Tiles' three shifts
// a vector (the rounding bit, the code, the sign) and its clamp leave port 0 the bottleneck.
// Here:
// - the rounding bit is bit 4 of the input itself (the bias is a multiple of 128, and when
//   t's low four bits exceed 8 the +7 has already carried), added by a masked add;
// - the code, bits 4-11 of t + 7 + odd, is picked into a byte by vpmultishiftqb (port 5), two
//   vectors' codes merged by a blend and put in order by one dword permute;
// - the signs are the high bytes of the input, gathered by one two-source byte permute;
// - no clamp at 0x7E: a tile's scale puts its amax at or below 448 (E4m3ScaleExponent), and
//   the code of any value of the tile is at most the amax's (this encoder, like the other,
//   is only given the scale row ScaleRow computed from the same row).
// False if a lane is in the e4m3 subnormal range (as OutsideSubnormalRange).
// `ahead`, if not null: a row whose lines [0, kTile * kTiles / 32) are requested, two a step.
template <int kTile, int kTiles>
HWY_INLINE bool CodeE4m3TilesVbmi(const uint16_t* row, uint8_t* data, const uint8_t* e,
                                  const char* ahead) {
  static_assert(kTile * kTiles % 64 == 0 && kTiles <= 16);
  // Per tile, E4m3Bias's two constants twice in a 32-bit lane: broadcast from memory, a
  // dword broadcast is a plain load, where one from a register would take port 5.
  alignas(64) uint32_t normal[16], subnormal[16];
  {
    const __m512i e128 = _mm512_slli_epi32(
        _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8((1u << kTiles) - 1, e)), 7);
    const __m512i twice = _mm512_set1_epi32(0x10001);
    _mm512_store_si512(normal, _mm512_mullo_epi32(
                                   _mm512_sub_epi32(e128, _mm512_set1_epi32(7 * 128 + 7)), twice));
    _mm512_store_si512(subnormal, _mm512_mullo_epi32(
                                      _mm512_sub_epi32(e128, _mm512_set1_epi32(10 * 128)), twice));
  }
  // Without this the compiler keeps the arrays in registers and broadcasts on port 5.
  asm("" : "+m"(normal), "+m"(subnormal));
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF), bit4 = _mm512_set1_epi16(0x10);
  const __m512i one = _mm512_set1_epi16(1), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  // Bytes 0-3 of each 64-bit lane: bits 4-11 of its four 16-bit lanes; bytes 4-7 the same.
  const __m512i code_bits = _mm512_set1_epi64(0x3424140434241404);
  // The blend leaves the first vector's 32-bit lane j at 2j and the second's at 2j + 1.
  const __m512i in_order =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  // Byte j: the high byte of value j of the two vectors (bytes 2j + 1 of 128).
  alignas(64) static constexpr uint8_t kHighBytes[64] = {
      1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
      45, 47, 49, 51, 53, 55, 57, 59, 61, 63, 65, 67, 69, 71, 73, 75, 77, 79, 81, 83, 85, 87,
      89, 91, 93, 95, 97, 99, 101, 103, 105, 107, 109, 111, 113, 115, 117, 119, 121, 123, 125, 127};
  const __m512i high_bytes = _mm512_load_si512(kHighBytes);
  __m512i nearest = _mm512_set1_epi16(-1);
  auto code = [&](__m512i bits, int t) HWY_ATTR {
    const __m512i a = _mm512_and_si512(bits, magnitude);
    const __m512i tb = _mm512_subs_epu16(a, _mm512_set1_epi32(static_cast<int>(normal[t])));
    nearest = _mm512_min_epu16(
        nearest, _mm512_sub_epi16(a, _mm512_set1_epi32(static_cast<int>(subnormal[t]))));
    return _mm512_multishift_epi64_epi8(
        code_bits, _mm512_mask_add_epi16(tb, _mm512_test_epi16_mask(bits, bit4), tb, one));
  };
#pragma GCC unroll 8
  for (int i = 0; i < kTile * kTiles; i += 64) {
    if (ahead != nullptr) RequestRowLines(ahead, i / 32, i / 32 + 2);
    const __m512i first = _mm512_loadu_si512(row + i), second = _mm512_loadu_si512(row + i + 32);
    const __m512i codes = _mm512_permutexvar_epi32(
        in_order, _mm512_mask_blend_epi32(0xAAAA, code(first, i / kTile),
                                          code(second, (i + 32) / kTile)));
    const __m512i signs = _mm512_permutex2var_epi8(first, high_bytes, second);
    _mm512_storeu_si512(data + i, _mm512_ternarylogic_epi32(codes, signs, sign, 0xF8));  // a | b & c
  }
  return _mm512_cmplt_epu16_mask(nearest, _mm512_set1_epi16(512)) == 0;
}
#endif

// numerics::V4ScaleExponent and V41ScaleExponent of a tile whose amax has the bf16 magnitude
// bits a = E << 7 | m, in integers: amax / 448 exceeds 2^k exactly when amax exceeds
// 1.75 * 2^(k + 8), i.e. when E - 127 > k + 8 or E - 127 = k + 8 with m above 0x60 (1.75's
// mantissa bits); an fp32 amax / 448 never rounds onto a power of two it does not equal
// (amax has 8 significant bits). Then the floor: V4's 1e-4 / 448 takes exponent 105, V41's
// 2^-13 is 114. The division and float compare these replace were most of a tile's cost;
// cpu_exhaustive_test checks every finite amax against the scalar functions.
constexpr int kV4MinExponent = 105;
constexpr int kV41MinExponent = 114;
HWY_INLINE uint8_t E4m3ScaleExponent(int a, int min_exponent) {
  const int e = (a >> 7) - 8 + ((a & 0x7F) > 0x60 ? 1 : 0);
  return static_cast<uint8_t>(e > min_exponent ? e : min_exponent);
}

// Tiles' maxima are reduced eight at a time by interleaving within 128-bit blocks, which
// x86 and NEON do per block; other targets (SVE, RVV) reduce tile by tile.
#if HWY_ARCH_X86 || HWY_TARGET == HWY_NEON
constexpr bool kBlockwiseInterleave = true;
#else
constexpr bool kBlockwiseInterleave = false;
#endif

using D8x16 = hn::CappedTag<uint16_t, 8>;

// The largest magnitude bits of `kTile` values as a vector (its largest lane is the tile's).
template <int kTile>
HWY_INLINE VU16 TileMaxVector(DU16 du, const uint16_t* p) {
  const int n = static_cast<int>(hn::Lanes(du));
  const VU16 magnitude = hn::Set(du, 0x7FFF);
  VU16 max = hn::And(hn::LoadU(du, p), magnitude);
  for (int i = n; i < kTile; i += n) max = hn::Max(max, hn::And(hn::LoadU(du, p + i), magnitude));
  return max;
}

// In each 128-bit block, lane i: the largest lane of v[i] within that block. Three rounds
// of interleave-and-max (16, 32, 64 bits), which x86 and NEON do per block: about 3
// operations per vector instead of a horizontal reduction each. Any vector width.
template <class DU>
HWY_INLINE hn::Vec<DU> BlockwiseLargest(const hn::Vec<DU> (&v)[8]) {
  const DU du;
  const hn::RepartitionToWide<DU> d32;
  const hn::RepartitionToWide<decltype(d32)> d64;
  using V = hn::Vec<DU>;
  auto merge = [&](auto dw, V a, V b) HWY_ATTR {
    const auto wa = hn::BitCast(dw, a), wb = hn::BitCast(dw, b);
    return hn::Max(hn::BitCast(du, hn::InterleaveLower(dw, wa, wb)),
                   hn::BitCast(du, hn::InterleaveUpper(dw, wa, wb)));
  };
  return merge(d64, merge(d32, merge(du, v[0], v[1]), merge(du, v[2], v[3])),
               merge(d32, merge(du, v[4], v[5]), merge(du, v[6], v[7])));
}

// Lane i (of 8): the largest lane of v[i]: BlockwiseLargest, then the blocks merged.
template <class DU = DU16>  // a template so that only the branch of the target compiles
HWY_INLINE hn::Vec<D8x16> LargestPerVector(const hn::Vec<DU> (&v)[8]) {
  const auto r = BlockwiseLargest<DU>(v);
  if constexpr (hn::MaxLanes(DU()) > 8) {
    const D8x16 dh;
    return hn::Max(hn::LowerHalf(dh, r), hn::UpperHalf(dh, r));
  } else {
    return r;
  }
}

// V41_FP4's scale of fp32 lanes holding tile amaxes, as the scalar rule computes it: the
// same IEEE product and clamps.
template <class DF>
HWY_INLINE hn::Vec<DF> Fp4ScaleOf(DF df, hn::Vec<DF> amax) {
  const auto s = hn::Mul(amax, hn::Set(df, numerics::BitsToFloat(0x3E2AAAABu)));  // fp32(1/6)
  return hn::Min(hn::Max(s, hn::Set(df, 0.001953125f)), hn::Set(df, 448.0f));
}

// The e4m3 code of scales s below 2^-6 (subnormal): s * 2^9 rounded to an integer 1..8 (8 is
// code 0x08) by adding 2^23.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> Fp4SubnormalScaleCodes(DF df, hn::Vec<DF> s) {
  const hn::RebindToSigned<DF> di32;
  const auto steps = hn::Add(hn::Mul(s, hn::Set(df, 512.0f)), hn::Set(df, 8388608.0f));
  return hn::Sub(hn::BitCast(di32, steps), hn::Set(di32, 0x4B000000));
}

// numerics::Fp4ScaleCode of fp32 lanes holding tile amaxes, as int32 lanes: the scale by
// Fp4ScaleOf, then its e4m3 code by bit arithmetic (normal: 3 mantissa bits rounded to
// nearest even by the carry trick).
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> Fp4ScaleCodesOf(DF df, hn::Vec<DF> amax) {
  const hn::RebindToSigned<DF> di32;
  const auto s = Fp4ScaleOf(df, amax);
  const auto u = hn::BitCast(di32, s);
  // Normal (s >= 2^-6): exponent and 3 mantissa bits, RNE on the 20 bits dropped; s <= 448
  // keeps the code at most 0x7E.
  const auto rounded =
      hn::Add(hn::Add(u, hn::Set(di32, 0x7FFFF)), hn::And(hn::ShiftRight<20>(u), hn::Set(di32, 1)));
  const auto normal = hn::Sub(hn::ShiftRight<20>(rounded), hn::Set(di32, 120 << 3));
  return hn::IfThenElse(hn::Lt(u, hn::Set(di32, 0x3C800000)), Fp4SubnormalScaleCodes(df, s),
                        normal);
}

// numerics::Fp4ScaleCode of the tiles' amax bits in `amax` (8 lanes) into codes[0..8): on
// AVX2 and up by Fp4ScaleCodesOf; elsewhere by Fp4Tables' lookup, which the 32 KiB table
// makes a cache miss on rows with varied magnitudes. (A template so that only the branch of
// the target compiles.)
template <class D8 = D8x16>
HWY_INLINE void Fp4ScaleCodes(hn::Vec<D8> amax, const Fp4Tables& tables, uint8_t* codes) {
  if constexpr (HWY_TARGET <= HWY_AVX2 && HWY_ARCH_X86) {
    const hn::Rebind<uint32_t, D8> du32;
    const hn::Rebind<float, D8> df;
    const hn::Rebind<uint8_t, D8> dbytes;
    const auto value = hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, amax)));
    hn::StoreU(hn::DemoteTo(dbytes, Fp4ScaleCodesOf(df, value)), dbytes, codes);
  } else {
    constexpr size_t kLanes = hn::MaxLanes(D8());
    alignas(32) uint16_t amaxes[kLanes];
    hn::Store(amax, D8(), amaxes);
    for (size_t j = 0; j < kLanes; ++j) codes[j] = tables.scale_code[amaxes[j]];
  }
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// V41_FP4's scale row where vectors hold 512 bits: each vector holds two 16-value tiles.
// Each half row's eight vectors reduce in BlockwiseLargest's three rounds (block b of the
// result holds, in lane j, vector j's maximum over block b: blocks 0-1 are tile 2j's values,
// blocks 2-3 tile 2j + 1's), and one more round of 128-bit blocks leaves all 32 tiles' amax
// in one vector. Their codes come from Fp4Tables::scale_by_mantissa: a shift, an in-register
// lookup, an add and a minimum for all 32 (tiles with a subnormal scale, below
// scale_fast_min, take Fp4SubnormalScaleCodes instead).
HWY_INLINE bool ScaleFp4RowWide(const uint16_t* row, uint8_t* scale, const Fp4Tables& tables) {
  using DW = hn::CappedTag<uint16_t, 32>;
  using VW = hn::Vec<DW>;
  const DW dw;
  const VW magnitude = hn::Set(dw, 0x7FFF);
  VW halves[2];
  for (int g = 0; g < 2; ++g) {  // 16 tiles of 16 values
    VW v[8];
    // Unrolled so that the vectors stay in registers (at -O2 GCC keeps the array in memory).
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) v[j] = hn::And(hn::LoadU(dw, row + g * 256 + j * 32), magnitude);
    halves[g] = BlockwiseLargest<DW>(v);
  }
  // Lane 8 * b + j of `amax`: in block 0 tile 2j, block 1 tile 2j + 1, blocks 2-3 the same
  // of tiles 16 and up.
  constexpr auto lane = [](int t) { return (t & 16) + (t & 1) * 8 + (t & 15) / 2; };
  const __m512i low = halves[0].raw, high = halves[1].raw;
  const __m512i amax = _mm512_max_epu16(_mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
  // Each lane's table entry (by the low 7 bits of its amax, the mantissa), then its code.
#if HWY_TARGET == HWY_AVX3_DL
  const __m512i entry = _mm512_maskz_permutex2var_epi8(
      0x5555555555555555ull, _mm512_load_si512(tables.scale_by_mantissa), amax,
      _mm512_load_si512(tables.scale_by_mantissa + 64));
#else
  const __m512i* entries = reinterpret_cast<const __m512i*>(tables.scale_by_mantissa16);
  const __m512i entry = _mm512_mask_blend_epi16(
      _mm512_test_epi16_mask(amax, _mm512_set1_epi16(0x40)),
      _mm512_permutex2var_epi16(_mm512_load_si512(entries), amax, _mm512_load_si512(entries + 1)),
      _mm512_permutex2var_epi16(_mm512_load_si512(entries + 2), amax,
                                _mm512_load_si512(entries + 3)));
#endif
  __m512i codes = _mm512_min_epu16(_mm512_add_epi16(_mm512_srli_epi16(amax, 4), entry),
                                   _mm512_set1_epi16(kFp4ScaleFastLimit));
  // Tiles whose scale is subnormal (amax below scale_fast_min, at most 0x3DC0 by
  // cpu_ops_test: scale below 2^-6): their codes by Fp4SubnormalScaleCodes, in two vectors of
  // 16 fp32 lanes (a bf16 is the upper half of its fp32).
  const __mmask32 subnormal = _mm512_cmplt_epu16_mask(
      amax, _mm512_set1_epi16(static_cast<int16_t>(tables.scale_fast_min)));
  if (HWY_UNLIKELY(subnormal != 0)) {
    const hn::Full512<uint32_t> du32;
    const hn::Full512<float> df;
    const hn::Vec512<uint32_t> pairs{amax};
    const auto codes_of = [&](hn::Vec512<uint32_t> bits) HWY_ATTR {
      return hn::BitCast(du32, Fp4SubnormalScaleCodes(df, Fp4ScaleOf(df, hn::BitCast(df, bits))));
    };
    const auto even = codes_of(hn::ShiftLeft<16>(pairs));
    const auto odd = codes_of(hn::And(pairs, hn::Set(du32, 0xFFFF0000u)));
    // The low word of each even result and the odd one's shifted up (the results of tiles
    // not subnormal can exceed 16 bits, and are not kept).
    const __m512i both = _mm512_mask_blend_epi16(0xAAAAAAAAu, even.raw, hn::ShiftLeft<16>(odd).raw);
    codes = _mm512_mask_blend_epi16(subnormal, codes, both);
  }
  // Code t is the low byte of word lane(t).
#if HWY_TARGET == HWY_AVX3_DL
  alignas(64) static constexpr auto kOrder = [lane] {
    std::array<uint8_t, 64> order{};
    for (int t = 0; t < kHeadDim / 16; ++t) order[t] = static_cast<uint8_t>(2 * lane(t));
    return order;
  }();
  const __m256i ordered = _mm512_castsi512_si256(
      _mm512_permutexvar_epi8(_mm512_load_si512(kOrder.data()), codes));
#else
  alignas(64) static constexpr auto kOrder = [lane] {
    std::array<uint16_t, 32> order{};
    for (int t = 0; t < kHeadDim / 16; ++t) order[t] = static_cast<uint16_t>(lane(t));
    return order;
  }();
  const __m256i ordered =
      _mm512_cvtepi16_epi8(_mm512_permutexvar_epi16(_mm512_load_si512(kOrder.data()), codes));
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(scale), ordered);
  return _mm512_cmpgt_epu16_mask(amax, _mm512_set1_epi16(kNonFiniteMagnitude - 1)) == 0;
}
#endif

// The scale row of a row into scale: V4 7 exponents and the zero pad byte, V41 16
// exponents, V41_FP4 32 e4m3 codes. False if the row holds NaN or Inf (all 512 values are
// looked at, V4's RoPE dims too), and the scale row is then meaningless.
template <Layout kLayout>
bool ScaleRowT(const uint16_t* row, uint8_t* scale, const Fp4Tables& tables) {
  constexpr int kTile = GetLayoutInfo(kLayout).tile;
  constexpr int kTiles = (kLayout == Layout::kV4 ? kNopeDim : kHeadDim) / kTile;
  constexpr int kMinExponent = kLayout == Layout::kV4 ? kV4MinExponent : kV41MinExponent;
  if constexpr (!kBlockwiseInterleave) {
    const D16 d;
    int row_max = 0;
    for (int t = 0; t < kTiles; ++t) {
      const int amax = TileAmax(d, row + t * kTile, kTile);
      row_max = std::max(row_max, amax);
      if constexpr (kLayout == Layout::kV41Fp4) {
        scale[t] = tables.scale_code[amax];
      } else {
        scale[t] = E4m3ScaleExponent(amax, kMinExponent);
      }
    }
    if constexpr (kLayout == Layout::kV4) {
      row_max = std::max(row_max, TileAmax(d, row + kNopeDim, kRopeDim));
      scale[7] = 0;
    }
    return row_max < kNonFiniteMagnitude;
  } else {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    if constexpr (kLayout == Layout::kV41Fp4) return ScaleFp4RowWide(row, scale, tables);
#endif
    // Groups of 8 tiles; V4's 7 NoPE tiles take its RoPE dims (one more 64-value tile) as
    // the 8th, for the finite check only.
    static_assert(kLayout != Layout::kV4 || (kTiles == 7 && kRopeDim == kTile));
    constexpr int kGroups = kLayout == Layout::kV4 ? 1 : kTiles / 8;
    const DU16 du;
    const D8x16 d8;
    const hn::RebindToSigned<D8x16> di8;
    const hn::Rebind<uint8_t, D8x16> dbytes;
    auto row_max = hn::Zero(d8);
    for (int g = 0; g < kGroups; ++g) {
      VU16 tiles[8];
#pragma GCC unroll 8  // as in ScaleFp4RowWide
      for (int j = 0; j < 8; ++j) tiles[j] = TileMaxVector<kTile>(du, row + (g * 8 + j) * kTile);
      const auto amax = LargestPerVector(tiles);
      row_max = hn::Max(row_max, amax);
      if constexpr (kLayout == Layout::kV41Fp4) {
        Fp4ScaleCodes(amax, tables, scale + g * 8);
      } else {
        // E4m3ScaleExponent, lane by lane.
        const auto above = hn::VecFromMask(di8, hn::BitCast(di8, hn::And(amax, hn::Set(d8, 0x7F))) >
                                                    hn::Set(di8, 0x60));
        auto e = hn::Sub(hn::Sub(hn::BitCast(di8, hn::ShiftRight<7>(amax)), hn::Set(di8, 8)), above);
        e = hn::Max(e, hn::Set(di8, kMinExponent));
        hn::StoreU(hn::DemoteTo(dbytes, e), dbytes, scale + g * 8);
      }
    }
    if constexpr (kLayout == Layout::kV4) scale[7] = 0;
    return hn::GetLane(hn::MaxOfLanes(d8, row_max)) < kNonFiniteMagnitude;
  }
}

// V4 (NoPE tiles and the copied RoPE dims) and V41 codes of a finite row under its scale
// row. The sign bit is copied, so -0 and negative values that round to zero give 0x80, as in
// the reference. `ahead`: a row to request (RequestRowLines), or null.
template <Layout kLayout>
void EncodeE4m3Row(const uint16_t* row, const uint8_t* scale, uint8_t* data, const char* ahead) {
  constexpr int kTile = GetLayoutInfo(kLayout).tile;
  constexpr int kTiles = (kLayout == Layout::kV4 ? kNopeDim : kHeadDim) / kTile;
  // The fix is needed only for values some 2^14 below their tile's amax: rare in real rows,
  // so a row that has any is coded a second time, exactly.
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL
  const bool exact = CodeE4m3TilesVbmi<kTile, kTiles>(row, data, scale, ahead);
  if (ahead != nullptr) RequestRowLines(ahead, kTile * kTiles / 32, kBf16RowBytes / 64);
#else
  if (ahead != nullptr) RequestRowLines(ahead, 0, kBf16RowBytes / 64);
  const bool exact = CodeE4m3Tiles<kTile, kTiles, /*kExact=*/false>(row, data, scale);
#endif
  if (HWY_UNLIKELY(!exact)) CodeE4m3Tiles<kTile, kTiles, /*kExact=*/true>(row, data, scale);
  if constexpr (kLayout == Layout::kV4) {
    std::memcpy(data + kNopeDim, row + kNopeDim, kRopeDim * sizeof(uint16_t));
  }
}

// V41_FP4 codes of a finite row under its scale codes, by table (Fp4Tables::windowed): a
// magnitude's bits relative to its tile's scale S fall in a window w (kFp4WindowOffset and
// the constants beside it) that decides its code up to one, and the code is
// w + (|x| > threshold w), the threshold an in-register lookup. The sign is kept for
// every nonzero value (|x| / S >= 2^-142 never rounds to zero in fp32) and dropped for -0,
// as the reference's "+ 0.0f" does. A vector holds at most one tile (16 values, or 16 /
// lanes vectors a tile); AVX-512 codes two tiles a vector in EncodeFp4RowAvx512 below.
HWY_INLINE void EncodeFp4Tiles(const uint16_t* row, const uint8_t* scale, uint8_t* data,
                               const Fp4Tables& tables) {
  constexpr int kTile = 16;
  using D = D16;
  const D d;
  const hn::RebindToUnsigned<D> du;
  const int n = static_cast<int>(hn::Lanes(d));
  using V = hn::Vec<D>;
  const hn::Repartition<uint8_t, D> dbytes;
  const hn::Repartition<uint32_t, D> d32;
  const hn::Rebind<uint8_t, decltype(d32)> d8;
  const V magnitude = hn::Set(d, 0x7FFF);
  const V sign_bit = hn::Set(d, static_cast<int16_t>(0x8000));
  const V sign = hn::Set(d, 0x8);
  const auto last_window = hn::Set(du, kFp4LastWindowEnd);
  // A lane's lookup index of threshold k: its bytes 2k and 2k + 1, i.e. k * 0x0202 + 0x0100.
  const V index_step = hn::Set(d, 0x0202), base = hn::Set(d, 0x0100);
  uint8_t codes[kHeadDim / kTile];  // local: the stores into data could alias scale
  std::memcpy(codes, scale, sizeof(codes));
  for (int t = 0; t < kHeadDim / kTile; ++t) {
    // The tile's thresholds (entry 7: bits(S) - 128) in each 128-bit block of its values.
    const int16_t* entries = tables.windowed[codes[t]];
    const auto thresholds = hn::BitCast(dbytes, hn::LoadDup128(d, entries));
    const auto from = hn::Set(du, static_cast<uint16_t>(entries[7]));
    for (int i = t * kTile; i < (t + 1) * kTile; i += n) {
      const V bits = hn::LoadU(d, reinterpret_cast<const int16_t*>(row + i));
      const V a = hn::And(bits, magnitude);
      const V window = hn::BitCast(
          d, hn::ShiftRight<kFp4WindowShift>(
                 hn::Min(hn::SaturatedSub(hn::BitCast(du, a), from), last_window)));
      const V threshold = hn::BitCast(
          d, hn::TableLookupBytes(thresholds,
                                  hn::BitCast(dbytes, hn::Add(hn::Mul(window, index_step), base))));
      // Negative and nonzero: bits above 0x8000, i.e. bits ^ 0x8000 above 0 as int16.
      const V negative = hn::IfThenElseZero(hn::Xor(bits, sign_bit) > hn::Zero(d), sign);
      const V code = hn::Or(hn::Sub(window, hn::VecFromMask(d, a > threshold)), negative);
      // Two codes per 32-bit lane (dim 2j low, 2j+1 high) -> one byte: low | high << 4.
      auto pairs = hn::BitCast(d32, code);
      pairs = hn::Or(pairs, hn::ShiftRight<12>(pairs));
      hn::StoreU(hn::TruncateTo(d8, pairs), d8, data + i / 2);
    }
  }
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// EncodeFp4Tiles' window and one compare on AVX-512, two tiles per vector. Mask compares
// and masked adds bound this loop: the window needs one where a three-step search needed
// three, and the sign one more. Four vectors'
// codes become 64 bytes by a multiply-add of lane pairs (low + 16 * high) and two packs.
// Written with intrinsics: Highway 1.0 has neither masked arithmetic nor a two-input pack.
// `ahead`, if not null: a row requested four lines a step (RequestRowLines).
HWY_INLINE void EncodeFp4RowAvx512(const uint16_t* row, const uint8_t* scale, uint8_t* data,
                                   const Fp4Tables& tables, const char* ahead) {
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  const __m512i negative_zero = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  const __m512i last_window = _mm512_set1_epi16(kFp4LastWindowEnd);
  const __m512i one = _mm512_set1_epi16(1), sign = _mm512_set1_epi16(8);
  // A vector's lanes 0-15 are the first tile's (its table entries 0-7), 16-31 the second's
  // (entries 8-15); entry 7 of each is bits(S) - 128.
  const __m512i second_tile =
      _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(8), 1);
  const __m512i scale_entry = _mm512_or_si512(second_tile, _mm512_set1_epi16(7));
  const __m512i low_high = _mm512_set1_epi32(0x00100001);  // pair weights: 1 (dim 2j), 16 (2j+1)
  // The packs work within 128-bit blocks: dword 4j + k of the result is dword j of vector k.
  const __m512i in_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  uint8_t codes[kHeadDim / 16];  // local: the stores into data could alias scale
  std::memcpy(codes, scale, sizeof(codes));
  // Two tiles (one vector) into 32 lanes of nibble 2j + 16 * nibble 2j+1.
  auto code_pairs = [&](int t) HWY_ATTR {
    const __m256i both = _mm256_inserti128_si256(
        _mm256_castsi128_si256(
            _mm_load_si128(reinterpret_cast<const __m128i*>(tables.windowed[codes[t]]))),
        _mm_load_si128(reinterpret_cast<const __m128i*>(tables.windowed[codes[t + 1]])), 1);
    // Entries 16-31 are never looked up (indices stay below 16): left undefined, which spares
    // the instruction that would zero them.
    const __m512i table = _mm512_castsi256_si512(both);
    const __m512i bits = _mm512_loadu_si512(row + t * 16);
    const __m512i a = _mm512_and_si512(bits, magnitude);
    const __m512i window = _mm512_srli_epi16(
        _mm512_min_epu16(_mm512_subs_epu16(a, _mm512_permutexvar_epi16(scale_entry, table)),
                         last_window),
        kFp4WindowShift);
    const __m512i threshold =
        _mm512_permutexvar_epi16(_mm512_add_epi16(window, second_tile), table);
    __m512i code = _mm512_mask_add_epi16(window, _mm512_cmpgt_epi16_mask(a, threshold), window, one);
    // Negative and nonzero: bits above 0x8000 (unsigned); -0 codes as +0.
    code = _mm512_mask_add_epi16(code, _mm512_cmpgt_epu16_mask(bits, negative_zero), code, sign);
    return _mm512_madd_epi16(code, low_high);
  };
  for (int t = 0; t < kHeadDim / 16; t += 8) {  // 8 tiles: 4 vectors, 64 bytes of codes
    if (ahead != nullptr) RequestRowLines(ahead, t / 2, t / 2 + 4);
    const __m512i pairs[4] = {code_pairs(t), code_pairs(t + 2), code_pairs(t + 4),
                              code_pairs(t + 6)};
    const __m512i bytes = _mm512_packus_epi16(_mm512_packs_epi32(pairs[0], pairs[1]),
                                              _mm512_packs_epi32(pairs[2], pairs[3]));
    _mm512_storeu_si512(data + t * 8, _mm512_permutexvar_epi32(in_order, bytes));
  }
}
#endif

void EncodeFp4Row(const uint16_t* row, const uint8_t* scale, uint8_t* data,
                  const Fp4Tables& tables, const char* ahead) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  EncodeFp4RowAvx512(row, scale, data, tables, ahead);
#else
  if (ahead != nullptr) RequestRowLines(ahead, 0, kBf16RowBytes / 64);
  EncodeFp4Tiles(row, scale, data, tables);
#endif
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
  using D = TileTag<int16_t, kTile>;
  using V = hn::Vec<D>;
  const D d;
  const hn::Rebind<uint8_t, D> d8;
  const hn::Repartition<uint8_t, D> dbytes;
  const int n = static_cast<int>(hn::Lanes(d));
  const auto table = hn::LoadDup128(dbytes, kSubnormalBf16);
  const V low7 = hn::Set(d, 0x7F), low3 = hn::Set(d, 0x7), eight = hn::Set(d, 8);
  const V zero = hn::Zero(d), sign = hn::Set(d, static_cast<int16_t>(0x8000));  // code bit 7, << 8
  // Byte indices 2m, 2m + 1 of entry m.
  const V index_step = hn::Set(d, 0x0202), index_base = hn::Set(d, 0x0100);
  int16_t* out = reinterpret_cast<int16_t*>(row);
  for (int t = 0; t < kTiles; ++t) {
    const int e = scale[t];
    const V normal_bias = hn::Set(d, static_cast<int16_t>((e - 7) * 128));
    const V subnormal_bias = hn::Set(d, static_cast<int16_t>((e - 136) * 128));
    for (int i = t * kTile; i < (t + 1) * kTile; i += n) {
      const V code = hn::PromoteTo(d, hn::LoadU(d8, data + i));
      const V m = hn::And(code, low7);
      V value = hn::IfThenZeroElse(m == zero, hn::Add(hn::ShiftLeft<4>(m), normal_bias));
      if constexpr (kSubnormals) {
        const V index = hn::Add(hn::And(m, low3) * index_step, index_base);
        const V subnormal = hn::Add(
            hn::BitCast(d, hn::TableLookupBytes(table, hn::BitCast(dbytes, index))),
            subnormal_bias);
        value = hn::IfThenElse(m < eight, hn::IfThenZeroElse(m == zero, subnormal), value);
      }
      value = hn::OrAnd(value, hn::ShiftLeft<8>(code), sign);
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

// `ahead`: a row the coder requests into L2 as it goes (RequestRowLines), or null.
void EncodeRow(Layout layout, const uint16_t* row, const uint8_t* scale, uint8_t* data,
               const Fp4Tables& tables, const char* ahead) {
  WithLayout(layout, [&](auto l) HWY_ATTR {
    if constexpr (l() == Layout::kV41Fp4) {
      EncodeFp4Row(row, scale, data, tables, ahead);
    } else {
      EncodeE4m3Row<l()>(row, scale, data, ahead);
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
  EncodeRow(layout, row, scale_row, data, tables, /*ahead=*/nullptr);
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

// EncodeRows; while row i is coded, row i of `next` (the next block's rows, `next_count` of
// them) is requested from memory, so a block-by-block store keeps DRAM busy while it codes.
// Into L2 (it is read a block later): on two Intel cores that did as well as into L1 or
// better, and splitting the request between the scale and coding passes did worse on one of
// them; spread over the coding steps (EncodeRow's `ahead`) it did better on both
// (bench/RESULTS.md).
void EncodeRowsPrefetching(const PoolGeometry& geometry, const uint16_t* rows,
                           const uint8_t* scales, const int64_t* locs, int64_t count,
                           uint8_t* pool, bool stream, const uint16_t* next, int64_t next_count) {
  const Addressing locate(geometry);
  const Fp4Tables& tables = Fp4Tables::Get();
  const int data_bytes = static_cast<int>(locate.data_bytes);
  const int scale_bytes = static_cast<int>(locate.scale_bytes);
  for (int64_t i = 0; i < count; ++i) {
    const char* next_row =
        i < next_count ? reinterpret_cast<const char*>(next + i * kHeadDim) : nullptr;
    if (i + kPrefetchRows < count) {
      const RecordOffsets ahead = locate(locs[i + kPrefetchRows]);
      if (stream) {
        // Streamed data lines are written whole without being read: requesting them would
        // read each from DRAM for nothing. Only the partial lines at either end of the data
        // row (ordinary stores), where it has any (a pool aligned as the backends allocate
        // them has none), and the scale row's line are wanted in the cache.
        const uint8_t* data = pool + ahead.data;
        if (reinterpret_cast<uintptr_t>(data) % 64 != 0) __builtin_prefetch(data, 1);
        if (reinterpret_cast<uintptr_t>(data + data_bytes) % 64 != 0) {
          __builtin_prefetch(data + data_bytes - 1, 1);
        }
        __builtin_prefetch(pool + ahead.scale, 1);
      } else {
        PrefetchRecord(pool + ahead.data, data_bytes, pool + ahead.scale, /*for_write=*/true);
      }
    }
    const RecordOffsets at = locate(locs[i]);
    const uint8_t* scale = scales + i * scale_bytes;
    if (stream) {
      alignas(64) uint8_t data[kNopeDim + kRopeDim * 2];
      EncodeRow(geometry.layout, rows + i * kHeadDim, scale, data, tables, next_row);
      StreamCopy(data, pool + at.data, data_bytes);
    } else {
      EncodeRow(geometry.layout, rows + i * kHeadDim, scale, pool + at.data, tables, next_row);
    }
    std::memcpy(pool + at.scale, scale, scale_bytes);
  }
  if (stream) hwy::FlushStream();  // order the streamed lines before the caller's sync
}

void EncodeRowsImpl(const PoolGeometry& geometry, const uint16_t* rows, const uint8_t* scales,
                    const int64_t* locs, int64_t count, uint8_t* pool, bool stream) {
  EncodeRowsPrefetching(geometry, rows, scales, locs, count, pool, stream, nullptr, 0);
}

// Rows known finite, in blocks of 32 (32 KiB of bf16): scaled, then coded while the block
// is still in the core's cache and the next block is on its way from memory. False (and
// the store stopped part way) if a row was not finite after all. A block fits L1 (48 KiB on
// recent Intel cores), so the coding pass reads it from there rather than a second time
// from L2: on an Intel core blocks of 32 stored 4-10 % faster than blocks of 64, and blocks
// of 8, 16, 24 or 48 no faster than 32 (bench/RESULTS.md).
bool StoreCheckedRowsImpl(const PoolGeometry& geometry, const uint16_t* rows, const int64_t* locs,
                          int64_t count, uint8_t* pool, bool stream) {
  constexpr int64_t kBlock = 32;
  alignas(64) uint8_t scales[kBlock * (kHeadDim / 16)];  // the largest scale row: 32 bytes
  for (int64_t at = 0; at < count; at += kBlock) {
    const int64_t n = std::min(kBlock, count - at);
    const uint16_t* block = rows + at * kHeadDim;
    if (!ScaleRowsImpl(geometry.layout, block, n, scales)) return false;
    EncodeRowsPrefetching(geometry, block, scales, locs + at, n, pool, stream,
                          block + n * kHeadDim, std::min(kBlock, count - at - n));
  }
  return true;
}

void DequantizeRowsImpl(const PoolGeometry& geometry, const uint8_t* pool, const int64_t* locs,
                        int64_t count, uint16_t* out, int64_t out_row_stride, bool stream) {
  const Addressing locate(geometry);
  const Fp4Tables& tables = Fp4Tables::Get();
  const int data_bytes = static_cast<int>(locate.data_bytes);
  // Rows back to back (a workspace of whole rows): streamed as one region, whatever its
  // alignment.
  const bool one_region = stream && out_row_stride == kHeadDim;
  LineStream region(reinterpret_cast<uint8_t*>(out));
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
      const auto* bytes = reinterpret_cast<const uint8_t*>(scratch);
      if (one_region) {
        region.Append(bytes, kBf16RowBytes);
      } else {
        StreamCopy(bytes, reinterpret_cast<uint8_t*>(row), kBf16RowBytes);
      }
    } else {
      DequantizeRow(geometry.layout, pool + at.data, pool + at.scale, row, tables);
    }
  }
  if (one_region) region.Finish();
  if (stream) hwy::FlushStream();
}

void TranscodeRowsImpl(const PoolGeometry& from, const uint8_t* src, const PoolGeometry& to,
                       uint8_t* dst, const int64_t* locs, int64_t count, bool stream) {
  const Addressing locate_from(from), locate_to(to);
  const Fp4Tables& tables = Fp4Tables::Get();
  const int from_data_bytes = static_cast<int>(locate_from.data_bytes);
  const int to_data_bytes = static_cast<int>(locate_to.data_bytes);
  const int to_scale_bytes = static_cast<int>(locate_to.scale_bytes);
  alignas(64) uint16_t row[kHeadDim];
  for (int64_t i = 0; i < count; ++i) {
    if (i + kPrefetchRows < count) {
      const int64_t loc = locs[i + kPrefetchRows];
      const RecordOffsets in = locate_from(loc);
      PrefetchRecord(src + in.data, from_data_bytes, src + in.scale, /*for_write=*/false);
      if (!stream) {
        const RecordOffsets out = locate_to(loc);
        PrefetchRecord(dst + out.data, to_data_bytes, dst + out.scale, /*for_write=*/true);
      }
    }
    const RecordOffsets in = locate_from(locs[i]);
    const RecordOffsets out = locate_to(locs[i]);
    DequantizeRow(from.layout, src + in.data, src + in.scale, row, tables);
    if (stream) {
      alignas(64) uint8_t data[kNopeDim + kRopeDim * 2];
      alignas(32) uint8_t scale[kHeadDim / 16];
      QuantizeRow(to.layout, row, data, scale, tables);
      StreamCopy(data, dst + out.data, to_data_bytes);
      std::memcpy(dst + out.scale, scale, to_scale_bytes);
    } else {
      QuantizeRow(to.layout, row, dst + out.data, dst + out.scale, tables);
    }
  }
  if (stream) hwy::FlushStream();
}

// Copies `bytes` (whole bf16 values, any alignment) and says whether all were finite: the
// largest magnitude bits of the vectors copied, against the smallest non-finite one. Byte
// vectors, so that neither pointer need be aligned for 16-bit loads.
bool CopyFiniteImpl(const uint8_t* src, uint8_t* dst, size_t bytes) {
  size_t at = 0;
  int largest = 0;
#if HWY_TARGET != HWY_SCALAR  // one-byte vectors hold no bf16: the loop below does it all
  const hn::ScalableTag<uint8_t> d8;
  const hn::Repartition<uint16_t, decltype(d8)> d16;
  const size_t n = hn::Lanes(d8);
  const auto magnitude = hn::Set(d16, 0x7FFF);
  auto largest0 = hn::Zero(d16), largest1 = hn::Zero(d16);
  for (; at + 2 * n <= bytes; at += 2 * n) {
    const auto v0 = hn::LoadU(d8, src + at), v1 = hn::LoadU(d8, src + at + n);
    hn::StoreU(v0, d8, dst + at);
    hn::StoreU(v1, d8, dst + at + n);
    largest0 = hn::Max(largest0, hn::And(hn::BitCast(d16, v0), magnitude));
    largest1 = hn::Max(largest1, hn::And(hn::BitCast(d16, v1), magnitude));
  }
  largest = hn::GetLane(hn::MaxOfLanes(d16, hn::Max(largest0, largest1)));
#endif
  for (; at + 1 < bytes; at += 2) {
    const int v = src[at] | (src[at + 1] << 8);
    largest = std::max(largest, v & 0x7FFF);
    dst[at] = src[at];
    dst[at + 1] = src[at + 1];
  }
  if (at < bytes) dst[at] = src[at];  // an odd last byte: copied, not a value
  return largest < kNonFiniteMagnitude;
}

}  // namespace HWY_NAMESPACE
}  // namespace kvferry::cpu::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvferry::cpu::internal {

HWY_EXPORT(TargetImpl);
HWY_EXPORT(ScaleRowsImpl);
HWY_EXPORT(EncodeRowsImpl);
HWY_EXPORT(StoreCheckedRowsImpl);
HWY_EXPORT(DequantizeRowsImpl);
HWY_EXPORT(TranscodeRowsImpl);
HWY_EXPORT(CopyFiniteImpl);

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

bool StoreCheckedRows(const PoolGeometry& geometry, const uint16_t* rows, const int64_t* locs,
                      int64_t count, uint8_t* pool, bool stream) {
  return HWY_DYNAMIC_DISPATCH(StoreCheckedRowsImpl)(geometry, rows, locs, count, pool, stream);
}

void DequantizeRows(const PoolGeometry& geometry, const uint8_t* pool, const int64_t* locs,
                    int64_t count, uint16_t* out, int64_t out_row_stride, bool stream) {
  HWY_DYNAMIC_DISPATCH(DequantizeRowsImpl)(geometry, pool, locs, count, out, out_row_stride,
                                           stream);
}

void TranscodeRows(const PoolGeometry& from, const uint8_t* src, const PoolGeometry& to,
                   uint8_t* dst, const int64_t* locs, int64_t count, bool stream) {
  HWY_DYNAMIC_DISPATCH(TranscodeRowsImpl)(from, src, to, dst, locs, count, stream);
}

bool CopyFinite(const uint8_t* src, uint8_t* dst, size_t bytes) {
  return HWY_DYNAMIC_DISPATCH(CopyFiniteImpl)(src, dst, bytes);
}

}  // namespace kvferry::cpu::internal
#endif  // HWY_ONCE
