// What the fuzz targets make their buffers from: the fuzzer's bytes while they last, then a
// pattern seeded by them, so short inputs still describe large requests.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvferry::fuzz {

// `count` values of T: up to half of the remaining input, then xorshift bytes.
template <typename T>
std::vector<T> Fill(FuzzedDataProvider& in, size_t count) {
  std::vector<T> out(count);
  const size_t take = std::min(count * sizeof(T), in.remaining_bytes() / 2);
  const std::vector<uint8_t> bytes = in.ConsumeBytes<uint8_t>(take);
  if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  uint64_t x = in.ConsumeIntegral<uint64_t>() | 1;
  for (size_t i = bytes.size(); i < count * sizeof(T); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    reinterpret_cast<uint8_t*>(out.data())[i] = static_cast<uint8_t>(x);
  }
  return out;
}

// `count` bf16 values, all finite (the interesting arithmetic) except in one call out of
// `nonfinite_one_in`, which keeps whatever NaN/Inf the bytes hold.
inline std::vector<uint16_t> Bf16(FuzzedDataProvider& in, size_t count, int nonfinite_one_in) {
  std::vector<uint16_t> values = Fill<uint16_t>(in, count);
  if (in.ConsumeIntegralInRange<int>(0, nonfinite_one_in - 1) != 0) {
    for (uint16_t& v : values) {
      if ((v & 0x7f80) == 0x7f80) v &= 0xbfff;  // exponent all ones → finite
    }
  }
  return values;
}

}  // namespace kvferry::fuzz
