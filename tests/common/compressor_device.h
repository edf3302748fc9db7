// Device copies of compressor inputs, for the GPU tests and the compressor benchmark.
#pragma once

#include "common/compressor_inputs.h"
#include "common/cuda_testing.h"

namespace kvferry::testing {

class DeviceCompressorInputs {
 public:
  explicit DeviceCompressorInputs(const CompressorInputs& in)
      : kv_(in.kv), score_(in.score), weight_(in.weight), cos_(in.cos), sin_(in.sin),
        locs_(in.entry_locs) {}

  // `host` (from CompressorInputs::Params) with every input pointer moved to the device
  // copies; the output pointers (pool, pre_quant_rows) are the caller's.
  CompressorParams Params(CompressorParams host) const {
    host.kv = kv_.as<float>();
    host.score = score_.as<float>();
    host.norm_weight = weight_.as<uint16_t>();
    host.rope_cos = cos_.as<float>();
    host.rope_sin = sin_.as<float>();
    host.entry_locs = locs_.as<int64_t>();
    return host;
  }

 private:
  DeviceBuffer kv_, score_, weight_, cos_, sin_, locs_;
};

}  // namespace kvferry::testing
