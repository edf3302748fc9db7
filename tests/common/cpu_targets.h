// Running a test body once per instruction set the cpu fast path was compiled for and this
// CPU supports, by forcing Highway's runtime dispatch to each in turn.
#pragma once

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"

namespace kvferry::testing {

// Every target Highway generated code for that this CPU can run, best first.
inline std::vector<int64_t> CpuTargets() {
  hwy::SetSupportedTargetsForTest(0);  // undo any earlier forcing before asking
  return hwy::SupportedAndGeneratedTargets();
}

// Calls body() with dispatch forced to each target of CpuTargets(), then restores it.
template <typename Body>
void ForEachCpuTarget(const Body& body) {
  for (const int64_t target : CpuTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    body();
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace kvferry::testing
