// Lookup tables of the cpu fast path's V41_FP4 coding, derived from the scalar rules of
// numerics.h so that a lookup gives exactly the reference's answer.
#pragma once

#include <cstdint>

namespace kvferry::cpu::internal {

// V41_FP4's coding windows (Fp4Tables::windowed): a magnitude's window is
// min((bits(|x|) - bits(S) + kFp4WindowOffset) >> kFp4WindowShift, kFp4LastWindow).
inline constexpr int kFp4WindowOffset = 128;
inline constexpr int kFp4WindowShift = 6;  // windows 64 wide
inline constexpr int kFp4LastWindow = 6;
// The largest offset magnitude still in a window below the last: clamping to it caps the
// window at kFp4LastWindow.
inline constexpr int kFp4LastWindowEnd = ((kFp4LastWindow + 1) << kFp4WindowShift) - 1;

// Fp4Tables::scale_by_mantissa's cap: its low byte (1150 & 0xFF) is 0x7E, the largest code,
// which every amax whose scale is clamped at 448 gets.
inline constexpr int kFp4ScaleFastLimit = 1150;

struct Fp4Tables {
  // The scale code (numerics::Fp4ScaleCode) of a tile, by the bf16 magnitude bits of its
  // amax (finite values only: 0..0x7F7F).
  uint8_t scale_code[0x8000];
  // Quantization without a division: under scale code s (1..0x7E, the codes a store can
  // produce), a value's e2m1 magnitude code is the number of k in 0..6 with
  // |x| bits > windowed[s][k]. Exact because the reference's code is monotonic in |x|
  // (an IEEE division and round-to-nearest are), so each step of the code has a last
  // bf16 magnitude below it. Entry 7 is the bf16 bits of the scale's value less
  // kFp4WindowOffset (the scale, 2^-9..448, is exact in bf16). Relative to the scale the
  // thresholds lie in fixed 64-wide windows: bits(|x|) - bits(S) + 128 in [64k, 64k + 63] is
  // above threshold k - 1 and at most threshold k + 1, for every scale (cpu_ops_test codes
  // every value under every scale). So a magnitude's code is its window k (at most 6) plus
  // one compare with threshold k.
  alignas(16) int16_t windowed[128][8];
  // Dequantization: the bf16 bits of e2m1(nibble) * e4m3(s), low and high bytes, for
  // every scale byte s and nibble: byte tables for a 16-entry in-register lookup.
  alignas(16) uint8_t dequant_low[256][16];
  alignas(16) uint8_t dequant_high[256][16];

  // scale_code's codes by arithmetic and a 128-entry lookup (the 512-bit scale pass): where
  // the scale is a normal e4m3 value its code steps by 8 with each binade of the amax and,
  // within one, depends only on the amax's 7 mantissa bits. For bf16 magnitude bits a from
  // scale_fast_min up to 0x7F7F, scale_code[a] is the low byte of
  // min((a >> 4) + scale_by_mantissa[a & 0x7F], kFp4ScaleFastLimit) (checked for every such
  // a when the tables are built). Last in the struct: placed before the dequantization
  // tables, they slowed the V41_FP4 gather by a third on an Intel core (60 -> 80 ns a row).
  alignas(64) uint8_t scale_by_mantissa[128];
  alignas(64) uint16_t scale_by_mantissa16[128];  // the same, for 16-bit lookups
  uint16_t scale_fast_min;

  // Built once, on first use (about 0.1 ms); thread-safe.
  static const Fp4Tables& Get();
};

}  // namespace kvferry::cpu::internal
