// The cpu fast path's row loops, compiled once per instruction set (Highway) and dispatched
// at run time to the best one the CPU supports. Inputs are validated by the caller.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvferry/kernels/format.h"

namespace kvferry::cpu::internal {

// A store in two passes, so that nothing is written before every row is known finite.
// ScaleRows: the scale row of each of `count` rows ([count, 512] bf16) into
// scales[i * scale_bytes ..); false if any value is NaN or Inf.
bool ScaleRows(Layout layout, const uint16_t* rows, int64_t count, uint8_t* scales);
// EncodeRows: rows[i] under scale row i into the record of locs[i] (data and scale row).
// `stream`: write the data rows with non-temporal stores (for outputs far beyond the caches).
void EncodeRows(const PoolGeometry& geometry, const uint16_t* rows, const uint8_t* scales,
                const int64_t* locs, int64_t count, uint8_t* pool, bool stream);

// A store of rows already known finite, in one pass over memory: blocks of rows scaled and
// then coded from the cache; false if a row holds NaN or Inf after all (the store then
// stopped part way).
bool StoreCheckedRows(const PoolGeometry& geometry, const uint16_t* rows, const int64_t* locs,
                      int64_t count, uint8_t* pool, bool stream);

// The record of locs[i] into out[i * out_row_stride .. +512); `stream` as for EncodeRows.
void DequantizeRows(const PoolGeometry& geometry, const uint8_t* pool, const int64_t* locs,
                    int64_t count, uint16_t* out, int64_t out_row_stride, bool stream);

// quantize_to(dequantize_from(record)) of each location, from src into dst; `stream`: dst's
// whole lines written with non-temporal stores (for outputs beyond the caches).
void TranscodeRows(const PoolGeometry& from, const uint8_t* src, const PoolGeometry& to,
                   uint8_t* dst, const int64_t* locs, int64_t count, bool stream);

// Copies `bytes` from src to dst; true if every whole bf16 value among them is finite.
bool CopyFinite(const uint8_t* src, uint8_t* dst, size_t bytes);
// The instruction set the calls above dispatch to now (e.g. "AVX2").
const char* DispatchedTargetName();

}  // namespace kvferry::cpu::internal
