// Params of the KV ops, shared by every executor of them (CPU reference, CUDA launchers,
// the daemon's backends): plain structs of pointers and shapes, no device headers.
//
// Every pointer is memory the executor can address: host memory for the CPU, device (or
// device-mapped) memory for CUDA. Shapes are written next to pointers.
#pragma once

#include <cstdint>

#include "kvferry/kernels/format.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {

struct QuantizeStoreParams {
  PoolGeometry geometry;
  const uint16_t* rows = nullptr;  // [num_tokens, 512] bf16, 16-byte aligned
  const int64_t* locs = nullptr;   // [num_tokens] token locations, unique
  int64_t num_tokens = 0;
  uint8_t* pool = nullptr;         // geometry.pool_bytes(), 16-byte aligned
  // Optional (CUDA only): row i starts at rows + row_offsets[i] (elements, multiples of 8)
  // instead of rows + i * 512 — rows read in place from another tensor's blocks.
  const int64_t* row_offsets = nullptr;
  // Optional (CUDA only): set to nonzero when any row holds NaN or Inf. The records are
  // stored regardless; the caller undoes the store when the flag is set.
  uint32_t* nonfinite = nullptr;
  // cpu: scale and code each block of rows while it is in cache, reading the rows from
  // memory once instead of twice (cpu::QuantizeStoreCheckedRows). A NaN or Inf then fails
  // the op (INTERNAL) with the records of earlier blocks already written: for rows the
  // caller found finite before, or a `pool` the caller throws away when the op fails
  // (StagedWrite's staged records). Ignored on CUDA.
  bool single_pass = false;
};

struct DequantizeGatherParams {
  PoolGeometry geometry;
  const uint8_t* pool = nullptr;   // geometry.pool_bytes(), 16-byte aligned
  const int64_t* locs = nullptr;   // [num_tokens], repeats allowed
  int64_t num_tokens = 0;
  uint16_t* out = nullptr;         // row i at out[i * out_row_stride .. +512), bf16
  int64_t out_row_stride = kHeadDim;  // elements, >= 512; any value (aligned ones are faster)
  // Optional (CUDA only): row i at out + out_offsets[i] (elements) instead; every offset a
  // multiple of out_offset_align elements (8 or more takes the 16-byte store path).
  const int64_t* out_offsets = nullptr;
  int64_t out_offset_align = 1;
};

struct TranscodeParams {
  PoolGeometry from;
  const uint8_t* src = nullptr;    // from.pool_bytes()
  PoolGeometry to;
  uint8_t* dst = nullptr;          // to.pool_bytes(); must not overlap src
  const int64_t* locs = nullptr;   // [num_tokens], unique, in range of both pools
  int64_t num_tokens = 0;
  // Optional (CUDA only): record i goes to dst_locs[i] of `to` instead of locs[i]; then
  // locs index `from` only, and dst_locs must be unique.
  const int64_t* dst_locs = nullptr;
};

// Stored records moved between two pools of one layout (page sizes may differ), bytes as
// they are: record i of `from` (at src_locs[i], or at i when src_locs is null) becomes the
// record at dst_locs[i] of `to`. Host memory only (the cpu backend): the daemon's row
// writes quantize each message into staged records as it arrives, and the commit moves
// them to their locations.
struct CopyRecordsParams {
  PoolGeometry from;
  const uint8_t* src = nullptr;         // from.pool_bytes()
  const int64_t* src_locs = nullptr;    // [num_tokens], or null: 0, 1, ...
  PoolGeometry to;
  uint8_t* dst = nullptr;               // to.pool_bytes(); must not overlap src
  const int64_t* dst_locs = nullptr;    // [num_tokens], unique, in range of `to`
  int64_t num_tokens = 0;
};

struct PageCopyParams {
  PageCopyGeometry geometry;       // pool = [num_layers][num_pages][page_bytes]
  uint8_t* pool = nullptr;
  const int64_t* pages = nullptr;  // [num_listed] page ids (unique for scatter)
  int64_t num_listed = 0;
  uint8_t* buffer = nullptr;       // [num_listed][num_layers][page_bytes]; unused by zeroing
  // Optional (CUDA only): listed page i sits at buffer unit buffer_pages[i] instead of i
  // (unique for gather) — pages straight into or out of another tensor's blocks.
  const int64_t* buffer_pages = nullptr;
};

// Per-token indices of whole blocks moved to whole pages, built on the device so that a
// transfer of many tokens sends only per-page lists: token t of listed page i gets
//   row_offsets[i * page_size + t] = row0 + blocks[i] * block_stride + t * token_stride
//   locs[i * page_size + t]        = pages[i] * page_size + t
// (offsets and strides in elements of the rows' type).
struct ExpandBlockIndicesParams {
  const int64_t* blocks = nullptr;  // [num_listed]
  const int64_t* pages = nullptr;   // [num_listed]
  int64_t num_listed = 0;
  int page_size = 0;
  int64_t row0 = 0, block_stride = 0, token_stride = 0;
  int64_t* row_offsets = nullptr;   // [num_listed * page_size]
  int64_t* locs = nullptr;          // [num_listed * page_size]
};

}  // namespace kvferry
