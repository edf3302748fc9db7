// kvferryd entry point (placeholder until the daemon lands): reports version and formats.
#include <cstdio>

#include "kvferry/kernels/format.h"

int main() {
  std::printf("kvferryd %s\n", KVFERRY_VERSION);
  for (int i = 0; i < kvferry::kNumLayouts; ++i) {
    const auto layout = static_cast<kvferry::Layout>(i);
    const kvferry::Savings s = kvferry::ComputeSavings(layout, 64);
    std::printf("  %-8s %3.0f B/token, %.1f %% below bf16, %.1f %% below v4\n",
                kvferry::LayoutName(layout), s.nominal_bytes_per_token,
                100 * s.nominal_saved_vs_bf16, 100 * s.nominal_saved_vs_v4);
  }
  return 0;
}
