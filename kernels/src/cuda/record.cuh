// Encode/decode of one token record: the shared body of the CUDA kernels.
//
// A token is handled by 32 or 64 consecutive threads of a block, each owning kChunks = 2 or
// 1 of the row's 64 eight-value chunks: thread t owns chunk t (and t + 32 when it owns two;
// then one warp is one token). Either way a warp's global accesses are contiguous (16 B
// bf16 per thread per chunk, 8/4 B of codes), and a quantization tile is a group of 2
// (V41_FP4), 4 (V41) or 8 (V4) neighbouring lanes whose amax is a couple of xor shuffles.
// Two chunks per thread is the shape for throughput; one chunk per thread halves each
// thread's dependent chain, the shape for small launches. The scalar conversions are the
// ones of numerics.h, so results equal the CPU reference bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvferry/kernels/cuda_ops.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/numerics.h"

namespace kvferry::cuda::detail {

inline constexpr int kWarp = 32;
inline constexpr int kChunk = 8;                          // values per chunk
inline constexpr int kRowChunks = kHeadDim / kChunk;      // 64
inline constexpr int kNopeChunks = kNopeDim / kChunk;     // 56: V4 chunks 56..63 are RoPE
inline constexpr int kThreadsPerBlock = 256;              // the largest block of any shape
inline constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarp;  // tokens per block, 2 chunks

// The chunks of a token row a thread owns: v[k][j] is dim 8 * ChunkOf<kChunks>(t, k) + j,
// in fp32, and bits[k][j] its bf16 bits.
template <int kChunks>
struct RowShare {
  static_assert(kChunks == 1 || kChunks == 2);
  static constexpr int kThreadsPerToken = kRowChunks / kChunks;
  float v[kChunks][kChunk];
  uint16_t bits[kChunks][kChunk];
};

template <int kChunks>
__device__ __forceinline__ int ChunkOf(int t, int k) {
  return t + RowShare<kChunks>::kThreadsPerToken * k;
}

// Location → record pointers with the page size a compile-time constant.
template <Layout L, int kLog2Page>
struct Addressing {
  static constexpr LayoutInfo kInfo = GetLayoutInfo(L);
  static constexpr int kPageSize = 1 << kLog2Page;
  static constexpr int64_t kPageBytes = PageBytes(L, kPageSize);
  static constexpr int64_t kScaleOffset = ScaleOffset(L, kPageSize);

  __device__ __forceinline__ static void Locate(int64_t loc, int64_t& data, int64_t& scale) {
    const int64_t page = loc >> kLog2Page;
    const int64_t slot = loc & (kPageSize - 1);
    data = page * kPageBytes + slot * kInfo.data_bytes;
    scale = page * kPageBytes + kScaleOffset + slot * kInfo.scale_bytes;
  }
};

__device__ __forceinline__ void SplitBf16(uint4 raw, uint16_t (&bits)[kChunk], float (&v)[kChunk]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    bits[2 * j] = static_cast<uint16_t>(words[j] & 0xFFFFu);
    bits[2 * j + 1] = static_cast<uint16_t>(words[j] >> 16);
  }
#pragma unroll
  for (int j = 0; j < kChunk; ++j) v[j] = numerics::Bf16ToFloat(bits[j]);
}

__device__ __forceinline__ uint4 JoinBf16(const uint16_t (&bits)[kChunk]) {
  return make_uint4(bits[0] | (uint32_t{bits[1]} << 16), bits[2] | (uint32_t{bits[3]} << 16),
                    bits[4] | (uint32_t{bits[5]} << 16), bits[6] | (uint32_t{bits[7]} << 16));
}

// True when any of the chunk's bf16 values is NaN or ±Inf (exponent bits all ones).
__device__ __forceinline__ bool AnyNonFinite(const uint16_t (&bits)[kChunk]) {
  uint32_t hit = 0;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) hit |= (bits[j] & 0x7F80u) == 0x7F80u ? 1u : 0u;
  return hit != 0;
}

template <int kChunks>
__device__ __forceinline__ void LoadBf16Row(const uint16_t* __restrict__ row, int t,
                                            RowShare<kChunks>& r) {
  uint4 raw[kChunks];  // both loads issued before either is used
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    raw[k] = __ldg(reinterpret_cast<const uint4*>(row) + ChunkOf<kChunks>(t, k));
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k) SplitBf16(raw[k], r.bits[k], r.v[k]);
}

// Max of |v| over N (a power of two) values, as a tree. Values are finite, so fmaxf of
// magnitudes equals the reference's max on magnitude bits.
template <int N>
__device__ __forceinline__ float Amax(const float (&v)[N]) {
  float m[N];
#pragma unroll
  for (int j = 0; j < N; ++j) m[j] = fabsf(v[j]);
#pragma unroll
  for (int width = N / 2; width >= 1; width /= 2) {
#pragma unroll
    for (int j = 0; j < width; ++j) m[j] = fmaxf(m[j], m[j + width]);
  }
  return m[0];
}

// The max of m over the kGroup neighbouring lanes that share a tile, when each lane's m
// already covers kCovered (1 or 2) lanes' values.
template <int kGroup, int kCovered = 1>
__device__ __forceinline__ float TileMax(float m) {
#pragma unroll
  for (int offset = kCovered; offset < kGroup; offset <<= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
  }
  return m;
}

template <int kGroup, int N>
__device__ __forceinline__ float GroupAmax(const float (&v)[N]) {
  return TileMax<kGroup>(Amax(v));
}

// N values (a multiple of 4) times a power of two → N e4m3 codes in N / 4 words, with
// the hardware's round-to-nearest-even, saturate-to-finite conversion
// (cvt.rn.satfinite.e4m3x2.f32): the same rounding as numerics::FloatToE4m3, which
// numerics_gpu_test checks exhaustively.
template <int N>
__device__ __forceinline__ void PackE4m3Words(const float (&v)[N], float multiplier,
                                              uint32_t (&words)[N / 4]) {
#pragma unroll
  for (int w = 0; w < N / 4; ++w) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(v[4 * w], multiplier), __fmul_rn(v[4 * w + 1], multiplier)),
        __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(v[4 * w + 2], multiplier), __fmul_rn(v[4 * w + 3], multiplier)),
        __NV_SATFINITE, __NV_E4M3);
    words[w] = lo | (hi << 16);
  }
}

__device__ __forceinline__ uint2 PackE4m3(const float (&v)[kChunk], float multiplier) {
  uint32_t words[2];
  PackE4m3Words(v, multiplier, words);
  return make_uint2(words[0], words[1]);
}

// Eight bf16 values of one V41_FP4 tile → eight e2m1 nibbles under scale s, without the
// division of spec §4 step 2. For a bf16 input a = |x| and a threshold t of the e2m1
// rounding (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: each an even float), fl(a / s) <= t holds
// exactly when a <= t * s: t * s is exact (at most 7 significant bits), and no bf16 value
// lies strictly between t * s and the point (t + ulp(t) / 2) * s, where rounding of the
// quotient could cross t. The same holds for <. The sign comes from x < 0 (an input of -0
// gives +0, as "+ 0.0f" does; no bf16 quotient underflows to zero). The kernels use the
// cheaper EncodeE2m1; this threshold form is its independent cross-check in
// numerics_gpu_test, both compared with the reference for every bf16 value and scale.
__device__ __forceinline__ uint32_t PackE2m1(const float (&v)[kChunk], float s) {
  const float t025 = 0.25f * s, t075 = 0.75f * s, t125 = 1.25f * s, t175 = 1.75f * s;
  const float t250 = 2.5f * s, t350 = 3.5f * s, t500 = 5.0f * s;
  uint32_t packed = 0;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    const float a = fabsf(v[j]);
    const uint32_t code = (a > t025) + (a >= t075) + (a > t125) + (a >= t175) + (a > t250) +
                          (a >= t350) + (a > t500) + (v[j] < 0.0f ? 8u : 0u);
    packed |= code << (4 * j);
  }
  return packed;
}

// Tile scales on the device, for tiles of bf16 values (all the kernels see).
//
// V4 (§4: the smallest power of two >= fl(max(amax, 1e-4) / 448)): for a bf16 amax
// m · 2^E, amax / 448 = (m / 1.75) · 2^(E-8), and with 8 significant bits m / 1.75 is an
// exact power of two only at m = 1.75 and never rounds onto one otherwise; so the exponent
// is E - 8, plus one when m > 1.75, exactly the V41 rule without its floor. Below the
// 1e-4 floor the scale is fl(1e-4 / 448) rounded up to a power of two: 2^-22 (byte 105).
__device__ __forceinline__ uint8_t V4ScaleExponentBf16(float amax) {
  if (amax < 1e-4f) return 105;
  const uint32_t bits = numerics::FloatBits(amax);
  return static_cast<uint8_t>((bits >> 23) - 8 + ((bits & 0x7FFFFFu) > 0x600000u ? 1 : 0));
}

// V41_FP4 scale code (§4 step 1) with the hardware e4m3 conversion.
__device__ __forceinline__ uint8_t Fp4ScaleCodeFast(float amax) {
  const float s = fminf(fmaxf(__fmul_rn(amax, numerics::BitsToFloat(0x3E2AAAABu)), 0.001953125f),
                        448.0f);
  return static_cast<uint8_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(s, 0.0f), __NV_SATFINITE, __NV_E4M3) & 0xFFu);
}

// e4m3 code → fp32, with the hardware decode.
__device__ __forceinline__ float E4m3ToFloatFast(uint8_t code) {
  const __half_raw raw = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return __half2float(__half(raw));
}

// The multiplier EncodeE2m1 takes for an FP4 scale s: the hardware's approximate
// reciprocal, relative error below 2^-22 (s >= 2^-9, so no denormals).
__device__ __forceinline__ float E2m1Multiplier(float s) {
  float inv;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(s));
  return inv;
}

// PackE2m1 in half2 arithmetic, two values per instruction; `inv` is E2m1Multiplier(s).
// q = fma(x, inv, +0) is within 2^-21 of x / s and has the sign of x, except that x = -0
// gives +0 (the spec's "+ 0.0f"; no nonzero bf16 product underflows: |q| >= 2^-142). The
// conversion to fp16 (11 bits) then lands exactly on a rounding threshold t where
// |x| = t * s (a tie), and elsewhere stays on the correct side (a bf16 |x| is at least 2^-9
// relative away from any t * s, see PackE2m1); it keeps the sign even where the magnitude
// flushes to zero. On a = min(|q|, 6) the e2m1 rounding is the magic-number trick:
// (a + M) - M with M = 2^(exponent(a) + 9) (at least 512) rounds a to one mantissa bit,
// ties to even, on the e2m1 grid, and 6 is its top. Times 2^-14 the fp16 bits of the result
// are the magnitude code shifted left by 9; the sign bit (15) moves to the nibble's bit 3.
// Values are paired (v[p], v[p + N/2]) so each half2's two nibbles need one shift into place.
template <int N>
__device__ __forceinline__ uint32_t EncodeE2m1(const float (&v)[N], float inv) {
  static_assert(N == 4 || N == 8);
  const __half2 six = __float2half2_rn(6.0f);
  const __half2 to_code = __float2half2_rn(0.00006103515625f);  // 2^-14
  uint32_t packed = 0;
#pragma unroll
  for (int p = 0; p < N / 2; ++p) {
    __half2 q = __floats2half2_rn(__fmaf_rn(v[p], inv, 0.0f), __fmaf_rn(v[p + N / 2], inv, 0.0f));
    const __half2 a = __hmin2(__habs2(q), six);
    const uint32_t m_bits =
        __viaddmax_u16x2(*reinterpret_cast<const uint32_t*>(&a) & 0x7C007C00u, 0x24002400u,
                         0x60006000u);
    const __half2 m = *reinterpret_cast<const __half2*>(&m_bits);
    __half2 r = __hmul2(__hsub2(__hadd2(a, m), m), to_code);
    const uint32_t nibbles = (*reinterpret_cast<const uint32_t*>(&r) >> 9) |
                             ((*reinterpret_cast<const uint32_t*>(&q) >> 12) & 0x00080008u);
    packed |= nibbles << (4 * p);  // v[p] at bits 4p, v[p + 4] at 4p + 16
  }
  if constexpr (N == 4) packed = (packed | (packed >> 8)) & 0xFFFFu;  // v[p + 2] to 4p + 8
  return packed;
}

// Eight e4m3 codes times a power of two → eight bf16 bits (exact products; the hardware
// conversions decode e4m3 exactly and round to bf16 to nearest even).
__device__ __forceinline__ void UnpackE4m3(uint2 codes, float s, uint16_t (&bits)[kChunk]) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t word = p < 2 ? codes.x : codes.y;
    const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>((word >> (16 * (p & 1))) & 0xFFFFu), __NV_E4M3);
    const float2 f = __half22float2(__half2(raw));
    const __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(f.x, s), __fmul_rn(f.y, s));
    const __nv_bfloat162_raw b_raw(b);
    bits[2 * p] = b_raw.x;
    bits[2 * p + 1] = b_raw.y;
  }
}

// N (even, <= 8) e2m1 nibbles times an e4m3 scale → N bf16 bits. An e2m1 code's three
// magnitude bits placed at fp16 bits 11..9 (sign at 15) are the fp16 value code * 2^-14,
// exactly, subnormal 0.5 included; scaled by s * 2^14 in fp32 the products are exact.
template <int N>
__device__ __forceinline__ void UnpackE2m1(uint32_t codes, float s, uint16_t (&bits)[N]) {
  const float scale = __fmul_rn(s, 16384.0f);
#pragma unroll
  for (int p = 0; p < N / 2; ++p) {
    const uint32_t byte = (codes >> (8 * p)) & 0xFFu;
    const uint32_t h2 = ((byte & 0x7u) << 9) | ((byte & 0x8u) << 12) | ((byte & 0x70u) << 21) |
                        ((byte & 0x80u) << 24);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    const __nv_bfloat162_raw b_raw(__floats2bfloat162_rn(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale)));
    bits[2 * p] = b_raw.x;
    bits[2 * p + 1] = b_raw.y;
  }
}

// Writes chunk c (values v, bf16 bits `bits`) of a record and its tile's scale byte, given
// `amax`, the max of |v| and, when kCovered is 2, of the neighbouring chunk c ^ 1. All lanes
// of the warp must call (the tile amax shuffles). Every lane of a tile stores the same scale
// byte, so that store needs neither a branch nor a predicate.
template <Layout L, int kCovered = 1>
__device__ __forceinline__ void StoreChunk(const float (&v)[kChunk], const uint16_t (&bits)[kChunk],
                                           float amax, int c, uint8_t* __restrict__ data,
                                           uint8_t* __restrict__ scale) {
  constexpr int kGroup = GetLayoutInfo(L).tile / kChunk;  // lanes per tile
  if constexpr (L == Layout::kV41) {
    const uint8_t e = numerics::V41ScaleExponent(TileMax<kGroup, kCovered>(amax));
    *reinterpret_cast<uint2*>(data + kChunk * c) = PackE4m3(v, numerics::Ue8m0Reciprocal(e));
    scale[c >> 2] = e;
  } else if constexpr (L == Layout::kV4) {
    // Chunks 56..63 are the RoPE dims; their tile group of 8 lanes is all RoPE, so the
    // shuffles stay uniform. Codes are computed for them too (and dropped), and the two
    // stores are predicated, so the warp never diverges.
    const uint8_t e = V4ScaleExponentBf16(TileMax<kGroup, kCovered>(amax));
    const uint2 codes = PackE4m3(v, numerics::Ue8m0Reciprocal(e));
    const uint4 raw = JoinBf16(bits);
    const bool rope = c >= kNopeChunks;
    const size_t record = __cvta_generic_to_global(data);
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "setp.ne.b32 p, %0, 0;\n\t"
        "@p st.global.v4.b32 [%1], {%2, %3, %4, %5};\n\t"
        "@!p st.global.v2.b32 [%6], {%7, %8};\n\t}"
        :
        : "r"(static_cast<int>(rope)), "l"(record + kNopeDim + 16 * (c - kNopeChunks)),
          "r"(raw.x), "r"(raw.y), "r"(raw.z), "r"(raw.w), "l"(record + kChunk * c), "r"(codes.x),
          "r"(codes.y)
        : "memory");
    scale[c >> 3] = rope ? 0 : e;  // byte 7 is the pad byte
  } else {
    const uint8_t code = Fp4ScaleCodeFast(TileMax<kGroup, kCovered>(amax));
    *reinterpret_cast<uint32_t*>(data + 4 * c) =
        EncodeE2m1(v, E2m1Multiplier(E4m3ToFloatFast(code)));
    scale[c >> 1] = code;
  }
}

template <Layout L, int kChunks>
__device__ __forceinline__ void StoreRecord(const RowShare<kChunks>& r, int t,
                                            uint8_t* __restrict__ data,
                                            uint8_t* __restrict__ scale) {
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    StoreChunk<L>(r.v[k], r.bits[k], Amax(r.v[k]), ChunkOf<kChunks>(t, k), data, scale);
  }
}

// Reads a lane's two chunks of a record back into fp32 values and their bf16 bits. All
// loads are issued before any is decoded, so a token costs one memory round trip.
template <Layout L>
__device__ __forceinline__ void LoadRecord(const uint8_t* __restrict__ data,
                                           const uint8_t* __restrict__ scale, int lane,
                                           RowShare<2>& r) {
  constexpr int kChunksPerTile = GetLayoutInfo(L).tile / kChunk;
  uint4 raw[2] = {};
  uint8_t scales[2] = {};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int c = ChunkOf<2>(lane, k);
    if constexpr (L == Layout::kV41Fp4) {
      raw[k].x = __ldg(reinterpret_cast<const uint32_t*>(data) + c);
    } else if (L == Layout::kV4 && c >= kNopeChunks) {
      raw[k] = __ldg(reinterpret_cast<const uint4*>(data + kNopeDim) + (c - kNopeChunks));
    } else {
      const uint2 codes = __ldg(reinterpret_cast<const uint2*>(data) + c);
      raw[k].x = codes.x;
      raw[k].y = codes.y;
    }
    if (L != Layout::kV4 || c < kNopeChunks) scales[k] = __ldg(scale + c / kChunksPerTile);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int c = ChunkOf<2>(lane, k);
    if (L == Layout::kV4 && c >= kNopeChunks) {  // RoPE dims: the stored bf16 as they are
      SplitBf16(raw[k], r.bits[k], r.v[k]);
      continue;
    }
    if constexpr (L == Layout::kV41Fp4) {
      UnpackE2m1(raw[k].x, E4m3ToFloatFast(scales[k]), r.bits[k]);
    } else {
      UnpackE4m3(make_uint2(raw[k].x, raw[k].y), numerics::Ue8m0ToFloat(scales[k]), r.bits[k]);
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) r.v[k][j] = numerics::Bf16ToFloat(r.bits[k][j]);
  }
}

// Calls f(std::integral_constant<int, log2(page_size)>) for a supported page size.
template <typename F>
absl::Status DispatchPageSize(int page_size, F&& f) {
  switch (page_size) {
#define KVF_PAGE_CASE(LOG2) \
  case (1 << LOG2):         \
    return f(std::integral_constant<int, LOG2>{});
    KVF_PAGE_CASE(0)
    KVF_PAGE_CASE(1)
    KVF_PAGE_CASE(2)
    KVF_PAGE_CASE(3)
    KVF_PAGE_CASE(4)
    KVF_PAGE_CASE(5)
    KVF_PAGE_CASE(6)
    KVF_PAGE_CASE(7)
    KVF_PAGE_CASE(8)
    KVF_PAGE_CASE(9)
    KVF_PAGE_CASE(10)
    KVF_PAGE_CASE(11)
    KVF_PAGE_CASE(12)
#undef KVF_PAGE_CASE
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "page size ", page_size, " is not a power of two in [1, ", kMaxPageSize, "]"));
  }
}

// Calls f(std::integral_constant<Layout, L>{}) for the layout.
template <typename F>
absl::Status DispatchLayout(Layout layout, F&& f) {
  switch (layout) {
    case Layout::kV4:
      return f(std::integral_constant<Layout, Layout::kV4>{});
    case Layout::kV41:
      return f(std::integral_constant<Layout, Layout::kV41>{});
    case Layout::kV41Fp4:
      return f(std::integral_constant<Layout, Layout::kV41Fp4>{});
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown layout ", static_cast<int>(layout)));
}

// Programmatic dependent launch (sm_90+): a kernel waits for the grid before it in the
// stream to finish before reading memory, but is itself launched while that grid runs,
// which hides the launch latency of back-to-back small kernels. Without the launch
// attribute both instructions are no-ops.
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void AllowDependentGridLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Launches `kernel` with programmatic stream serialization allowed, in clusters of
// `cluster` CTAs when that is above 1; checks the launch.
template <typename... KernelArgs, typename... Args>
absl::Status LaunchClusterKernel(void (*kernel)(KernelArgs...), int64_t blocks, int threads,
                                 int cluster, cudaStream_t stream, const char* name,
                                 Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = static_cast<unsigned>(cluster);
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  config.attrs = attributes;
  config.numAttrs = cluster > 1 ? 2 : 1;
  const cudaError_t error = cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("launch of ", name, " failed: ", cudaGetErrorString(error)));
}

template <typename... KernelArgs, typename... Args>
absl::Status LaunchKernel(void (*kernel)(KernelArgs...), int64_t blocks, int threads,
                          cudaStream_t stream, const char* name, Args... args) {
  return LaunchClusterKernel(kernel, blocks, threads, 1, stream, name, args...);
}

// The token of the calling thread and its index t among the token's 64 / kChunks threads,
// after the PDL handshake. Tokens are numbered by global thread index, so a block may hold
// several tokens or part of one (blockDim.x a multiple of 32: a warp never splits a tile).
//
// With `early_launch` the next grid may launch before this one's prerequisite has finished
// (its own wait still holds it until this grid completes). On the H200 that shortens
// launches of blocks of one or two warps (a one-token quantize-store by 0.05 µs) but slows
// grids of 8-warp blocks, whose waiting successors take their SMs (bench/RESULTS.md).
template <int kChunks>
__device__ __forceinline__ int64_t ThreadToken(int& t, bool early_launch = false) {
  if (early_launch) {
    AllowDependentGridLaunch();
    WaitForPrerequisiteGrid();
  } else {
    WaitForPrerequisiteGrid();
    AllowDependentGridLaunch();
  }
  constexpr int kThreads = RowShare<kChunks>::kThreadsPerToken;
  const int64_t thread = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  t = static_cast<int>(thread & (kThreads - 1));
  return thread / kThreads;
}

// Reads the token's location; false when it is outside the pool. Callers validate
// locations on the host; the kernels still never touch memory outside the pool.
__device__ __forceinline__ bool TokenLocation(const int64_t* __restrict__ locs, int64_t token,
                                              int64_t pool_tokens, int64_t& loc) {
  loc = __ldg(locs + token);
  return loc >= 0 && loc < pool_tokens;
}

// A warp's token (a warp per token), its location and its record read back.
struct TokenRecord {
  int64_t token;
  int lane;
  int64_t loc;
  RowShare<2> row;
};

// Reads the record of the calling warp's token from `pool` (layout L); false when the token
// is past the end or its location is outside the pool.
template <Layout L, int kLog2Page>
__device__ __forceinline__ bool ReadTokenRecord(const uint8_t* __restrict__ pool,
                                                const int64_t* __restrict__ locs,
                                                int64_t num_tokens, int64_t pool_tokens,
                                                TokenRecord& out) {
  out.token = ThreadToken<2>(out.lane);
  if (out.token >= num_tokens || !TokenLocation(locs, out.token, pool_tokens, out.loc)) {
    return false;
  }
  int64_t data, scale;
  Addressing<L, kLog2Page>::Locate(out.loc, data, scale);
  LoadRecord<L>(pool + data, pool + scale, out.lane, out.row);
  return true;
}

inline int64_t BlocksFor(int64_t num_tokens) {
  return (num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
}

// Launch shape of a quantize-store: chunks per thread, threads per block, and whether the
// next grid may launch early (see ThreadToken).
struct QuantizeShape {
  int chunks;
  int threads;
  bool early_launch;
};

// Up to kSmallLaunchTokens tokens, one chunk per thread (64 threads per token) halves each
// thread's dependent chain; above, two chunks per thread (a warp per token, 8 per block)
// move the most bytes per instruction. Small launches take the block count that finished
// soonest in graph replays on the H200 (bench/RESULTS.md): one block for a single token,
// four blocks up to 16 tokens, then about one block per SM (128 blocks) up to 512 tokens.
inline constexpr int64_t kSmallLaunchTokens = 1024;

inline QuantizeShape ChooseQuantizeShape(int64_t num_tokens) {
  if (num_tokens > kSmallLaunchTokens) return {2, kThreadsPerBlock, false};
  int64_t threads = 64;
  if (num_tokens > 1) {
    const int64_t pow2 = std::bit_ceil(static_cast<uint64_t>(num_tokens));
    threads = std::clamp<int64_t>(num_tokens <= 16 ? pow2 * 16 : pow2 / 2,  // 4 or 128 blocks
                                  kWarp, kThreadsPerBlock);
  }
  return {1, static_cast<int>(threads), threads <= 2 * kWarp};
}

// Per-layout launchers, one explicit instantiation per .cu file. Quantize-store takes its
// shape (ChooseQuantizeShape in production; kernel_bench sweeps the others).
template <Layout L>
absl::Status LaunchQuantizeStore(const QuantizeStoreParams& p, const QuantizeShape& shape,
                                 cudaStream_t stream);
template <Layout L>
absl::Status LaunchDequantizeGather(const DequantizeGatherParams& p, cudaStream_t stream);
template <Layout From>
absl::Status LaunchTranscode(const TranscodeParams& p, cudaStream_t stream);

}  // namespace kvferry::cuda::detail
