// The DeepSeek-V4 KV compressors (spec/compressor.md): ratio 1, 2, 4 (C4A) and 128 (C128A).
//
// Rows of per-token kv / score state come in for consecutive absolute positions
// [first_position, first_position + num_rows). Every window that closes among them
// ((p + 1) % ratio == 0) and whose rows are all given (rows before position 0 do not exist
// and count as given) yields one compressed entry: pooled by a per-channel softmax,
// RMS-normalized, RoPE-rotated on dims 448..511 and stored, with the layout's bit-exact
// quantizer, into the pool location the caller names for it. Windows that would need rows
// before first_position are not produced: the caller passes enough history (ratio 4: the 4
// rows before the first window it wants; 128: the whole window).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kvferry/kernels/format.h"

namespace kvferry {

struct CompressorParams {
  int ratio = 4;                  // 1, 2, 4 or 128
  bool fp4_fake_quant = false;    // ratio 1 or 2 into a V4 / V41 pool only (spec step 5)
  float eps = 1e-6f;              // RMSNorm epsilon, > 0

  const float* kv = nullptr;      // [num_rows, coff * 512] fp32; coff = 2 for ratio 4, else 1
  const float* score = nullptr;   // [num_rows, coff * 512] fp32 (with the position bias
                                  // added); not read for ratio 1
  int64_t num_rows = 0;
  int64_t first_position = 0;     // absolute position of row 0, >= 0

  const uint16_t* norm_weight = nullptr;  // [512] bf16 RMSNorm weight
  const float* rope_cos = nullptr;        // [num_rope_positions, 32] fp32
  const float* rope_sin = nullptr;        // [num_rope_positions, 32] fp32
  int64_t num_rope_positions = 0;         // must cover every window's first position

  PoolGeometry geometry;          // the destination pool (one layer)
  uint8_t* pool = nullptr;        // geometry.pool_bytes()
  const int64_t* entry_locs = nullptr;  // [num_entries] pool location per entry, in order
  int64_t num_entries = 0;        // must equal CompressorEntryCount(...)

  // Optional [num_entries, 512] bf16: the row after step 4, before any fake quantization
  // and the store (for tests and debugging). Null to skip.
  uint16_t* pre_quant_rows = nullptr;
};

inline int CompressorCoff(int ratio) { return ratio == 4 ? 2 : 1; }
// Rows a window reads: ratio 4 overlaps the previous window (8 rows).
inline int CompressorSpan(int ratio) { return ratio == 4 ? 8 : ratio; }

// Position of the first entry's window end, and the number of entries, for the rows given.
struct CompressorWindows {
  int64_t first_end = 0;  // absolute position p of entry 0's window end
  int64_t count = 0;      // entries; entry j ends at first_end + j * ratio
};
CompressorWindows CompressorEntries(int ratio, int64_t first_position, int64_t num_rows);

// Host-side checks of everything but the contents of the arrays: ratio, eps, option
// compatibility, pointers, entry count, RoPE coverage, geometry.
absl::Status ValidateCompressorParams(const CompressorParams& params);

namespace reference {
// The CPU reference; every pointer is host memory. Also rejects non-finite kv/score/weight
// values and out-of-range or repeated entry locations, before writing anything.
absl::Status Compress(const CompressorParams& params);
}  // namespace reference

}  // namespace kvferry
