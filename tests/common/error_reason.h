// The machine-readable reason kvferryd attached to a finished call, as a client reads it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

namespace kvferry::testing {

// The `kvferry-error-reason` trailer of a finished call (empty when none).
inline std::string ReasonOf(const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto it = trailers.find("kvferry-error-reason");
  return it == trailers.end() ? "" : std::string(it->second.data(), it->second.size());
}

}  // namespace kvferry::testing
