// Warp-level encode/decode of one token record: the shared body of the CUDA kernels.
//
// One warp handles one token. Lane l owns two 8-value chunks of the 512-value row:
// chunk l (dims 8l..8l+7) and chunk l+32 (dims 256+8l..). Every global access of a warp
// is then contiguous (16 B bf16 per lane per chunk, 8/4 B of codes), and a quantization
// tile is a group of 2 (V41_FP4), 4 (V41) or 8 (V4) neighbouring lanes whose amax is a
// couple of xor shuffles. The scalar conversions are the ones of numerics.h, so results
// equal the CPU reference bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvferry/kernels/cuda_ops.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/numerics.h"

namespace kvferry::cuda::detail {

inline constexpr int kWarp = 32;
inline constexpr int kChunk = 8;           // values per chunk
inline constexpr int kChunksPerLane = 2;   // chunks l and l + 32
inline constexpr int kWarpsPerBlock = 8;   // tokens per block
inline constexpr int kThreadsPerBlock = kWarp * kWarpsPerBlock;

// A token row in registers: v[k][j] is dim 8 * (lane + 32k) + j, in fp32.
struct LaneRow {
  float v[kChunksPerLane][kChunk];
  uint16_t bits[kChunksPerLane][kChunk];  // bf16 bits of the same values
};

__device__ __forceinline__ int ChunkOf(int lane, int k) { return lane + kWarp * k; }

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

__device__ __forceinline__ void LoadBf16Row(const uint16_t* __restrict__ row, int lane,
                                            LaneRow& r) {
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row) + ChunkOf(lane, k));
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      r.bits[k][2 * j] = static_cast<uint16_t>(words[j] & 0xFFFFu);
      r.bits[k][2 * j + 1] = static_cast<uint16_t>(words[j] >> 16);
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) r.v[k][j] = numerics::Bf16ToFloat(r.bits[k][j]);
  }
}

// Max of |v| over the lane's chunk k, then over the `group` lanes that share a tile.
template <int kGroup>
__device__ __forceinline__ float TileAmax(const LaneRow& r, int k) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    const uint32_t a = numerics::FloatBits(r.v[k][j]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
#pragma unroll
  for (int offset = 1; offset < kGroup; offset <<= 1) {
    const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, m, offset);
    m = other > m ? other : m;
  }
  return numerics::BitsToFloat(m);
}

__device__ __forceinline__ uint2 PackE4m3(const float (&v)[kChunk], float multiplier) {
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    lo |= uint32_t{numerics::FloatToE4m3(__fmul_rn(v[j], multiplier))} << (8 * j);
    hi |= uint32_t{numerics::FloatToE4m3(__fmul_rn(v[j + 4], multiplier))} << (8 * j);
  }
  return make_uint2(lo, hi);
}

// Writes the lane's part of the record of `r` (all lanes of the warp must call).
template <Layout L>
__device__ __forceinline__ void StoreRecord(const LaneRow& r, int lane, uint8_t* __restrict__ data,
                                            uint8_t* __restrict__ scale) {
  if constexpr (L == Layout::kV41) {
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      const int c = ChunkOf(lane, k);
      const uint8_t e = numerics::V41ScaleExponent(TileAmax<4>(r, k));
      *reinterpret_cast<uint2*>(data + kChunk * c) = PackE4m3(r.v[k], numerics::Ue8m0Reciprocal(e));
      if ((c & 3) == 0) scale[c >> 2] = e;
    }
  } else if constexpr (L == Layout::kV4) {
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      const int c = ChunkOf(lane, k);
      // Chunks 56..63 (lanes 24..31 at k = 1) are the RoPE dims; their tile group of 8
      // lanes is all RoPE, so the shuffle stays uniform and its result is unused there.
      const uint8_t e = numerics::V4ScaleExponent(TileAmax<8>(r, k));
      if (c < kNopeDim / kChunk) {
        *reinterpret_cast<uint2*>(data + kChunk * c) =
            PackE4m3(r.v[k], numerics::Ue8m0Reciprocal(e));
        if ((c & 7) == 0) scale[c >> 3] = e;
      } else {
        uint4 raw;
        raw.x = r.bits[k][0] | (uint32_t{r.bits[k][1]} << 16);
        raw.y = r.bits[k][2] | (uint32_t{r.bits[k][3]} << 16);
        raw.z = r.bits[k][4] | (uint32_t{r.bits[k][5]} << 16);
        raw.w = r.bits[k][6] | (uint32_t{r.bits[k][7]} << 16);
        const int rope_chunk = c - kNopeDim / kChunk;
        *reinterpret_cast<uint4*>(data + kNopeDim + 16 * rope_chunk) = raw;
        if (rope_chunk == 0) scale[7] = 0;
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      const int c = ChunkOf(lane, k);
      const uint8_t code = numerics::Fp4ScaleCode(TileAmax<2>(r, k));
      const float s = numerics::E4m3ToFloat(code);
      uint32_t packed = 0;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        packed |= uint32_t{numerics::QuantizeFp4(r.v[k][j], s)} << (4 * j);
      }
      *reinterpret_cast<uint32_t*>(data + 4 * c) = packed;
      if ((c & 1) == 0) scale[c >> 1] = code;
    }
  }
}

// Reads the lane's part of a record back into fp32 values and their bf16 bits.
template <Layout L>
__device__ __forceinline__ void LoadRecord(const uint8_t* __restrict__ data,
                                           const uint8_t* __restrict__ scale, int lane,
                                           LaneRow& r) {
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int c = ChunkOf(lane, k);
    if constexpr (L == Layout::kV4 || L == Layout::kV41) {
      constexpr int kChunksPerTile = GetLayoutInfo(L).tile / kChunk;
      if (L == Layout::kV4 && c >= kNopeDim / kChunk) {
        const uint4 raw =
            __ldg(reinterpret_cast<const uint4*>(data + kNopeDim) + (c - kNopeDim / kChunk));
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          r.bits[k][2 * j] = static_cast<uint16_t>(words[j] & 0xFFFFu);
          r.bits[k][2 * j + 1] = static_cast<uint16_t>(words[j] >> 16);
        }
      } else {
        const uint2 codes = __ldg(reinterpret_cast<const uint2*>(data + kChunk * c));
        const float s = numerics::Ue8m0ToFloat(__ldg(scale + c / kChunksPerTile));
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          const uint8_t code = static_cast<uint8_t>(((j < 4 ? codes.x : codes.y) >> (8 * (j & 3))));
          r.bits[k][j] = numerics::FloatToBf16(__fmul_rn(numerics::E4m3ToFloat(code), s));
        }
      }
    } else {
      const uint32_t codes = __ldg(reinterpret_cast<const uint32_t*>(data + 4 * c));
      const float s = numerics::E4m3ToFloat(__ldg(scale + (c >> 1)));
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const uint8_t nibble = static_cast<uint8_t>((codes >> (4 * j)) & 0xFu);
        r.bits[k][j] = numerics::FloatToBf16(__fmul_rn(numerics::E2m1ToFloat(nibble), s));
      }
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

inline int64_t BlocksFor(int64_t num_tokens) {
  return (num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
}

// Checks the launch just made (configuration errors surface here, not at the next sync).
inline absl::Status CheckLaunch(const char* kernel) {
  const cudaError_t error = cudaPeekAtLastError();
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear the non-sticky error so later launches are not blamed
  return absl::InternalError(
      absl::StrCat("launch of ", kernel, " failed: ", cudaGetErrorString(error)));
}

// Per-layout launchers, one explicit instantiation per .cu file.
template <Layout L>
absl::Status LaunchQuantizeStore(const QuantizeStoreParams& p, cudaStream_t stream);
template <Layout L>
absl::Status LaunchDequantizeGather(const DequantizeGatherParams& p, cudaStream_t stream);
template <Layout From>
absl::Status LaunchTranscode(const TranscodeParams& p, cudaStream_t stream);

}  // namespace kvferry::cuda::detail
