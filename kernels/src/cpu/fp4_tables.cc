// Builds the V41_FP4 lookup tables from the scalar reference conversions.
#include "cpu/fp4_tables.h"

#include <algorithm>

#include "kvferry/kernels/numerics.h"

namespace kvferry::cpu::internal {
namespace {

constexpr int kMaxFiniteMagnitude = 0x7F7F;  // bf16 3.39e38

// The e2m1 magnitude code (0..7) of the value with bf16 magnitude bits `a` under scale s.
int MagnitudeCode(int a, float scale) {
  return numerics::QuantizeFp4(numerics::Bf16ToFloat(static_cast<uint16_t>(a)), scale) & 0x7;
}

void Build(Fp4Tables& t) {
  for (int a = 0; a < 0x8000; ++a) {
    t.scale_code[a] = numerics::Fp4ScaleCode(numerics::Bf16ToFloat(static_cast<uint16_t>(a)));
  }
  // The mantissa table from the binade [1, 2) (scale 1/6..1/3, normal), then the smallest
  // magnitude from which the formula gives scale_code's byte for every larger one.
  for (int m = 0; m < 128; ++m) {
    const int a = (127 << 7) | m;
    t.scale_by_mantissa[m] = static_cast<uint8_t>(t.scale_code[a] - (a >> 4));
    t.scale_by_mantissa16[m] = t.scale_by_mantissa[m];
  }
  auto fast = [&](int a) {
    return std::min((a >> 4) + t.scale_by_mantissa[a & 0x7F], kFp4ScaleFastLimit) & 0xFF;
  };
  int fast_min = kMaxFiniteMagnitude + 1;
  while (fast_min > 0 && fast(fast_min - 1) == t.scale_code[fast_min - 1]) --fast_min;
  t.scale_fast_min = static_cast<uint16_t>(fast_min);
  for (int s = 0; s < 128; ++s) {
    // Codes 0 and 0x7F are never a store's scale; their rows are filled but unused.
    const float scale = numerics::E4m3ToFloat(static_cast<uint8_t>(s == 0 ? 1 : s));
    for (int k = 0; k < 7; ++k) {
      // Binary search for the last magnitude whose code is <= k (code(0) is 0 <= k).
      int lo = 0, hi = kMaxFiniteMagnitude;
      while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (MagnitudeCode(mid, scale) <= k) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      t.windowed[s][k] = static_cast<int16_t>(lo);
    }
    t.windowed[s][7] = static_cast<int16_t>(numerics::FloatToBf16(scale) - kFp4WindowOffset);
  }
  for (int s = 0; s < 256; ++s) {
    const float scale = numerics::E4m3ToFloat(static_cast<uint8_t>(s));
    for (int nibble = 0; nibble < 16; ++nibble) {
      const uint16_t bits =
          numerics::FloatToBf16(numerics::E2m1ToFloat(static_cast<uint8_t>(nibble)) * scale);
      t.dequant_low[s][nibble] = static_cast<uint8_t>(bits & 0xFF);
      t.dequant_high[s][nibble] = static_cast<uint8_t>(bits >> 8);
    }
  }
}

}  // namespace

const Fp4Tables& Fp4Tables::Get() {
  static const Fp4Tables* const tables = [] {
    auto* t = new Fp4Tables;
    Build(*t);
    return t;
  }();
  return *tables;
}

}  // namespace kvferry::cpu::internal
