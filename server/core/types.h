// Plain value types of the core: page handles, token locations, pool configuration, stats.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvferry/kernels/format.h"

namespace kvferry::server {

// A page of a pool. The generation is opaque to clients: it names the pool's incarnation
// (high bits) and how often the page was freed (low bits), so a handle of a freed page or
// of an earlier pool under the same name is refused.
struct PageHandle {
  uint64_t page_id = 0;
  uint64_t generation = 0;
};

struct TokenLocation {
  PageHandle page;
  uint32_t slot = 0;
};

struct PoolConfig {
  std::string name;
  Layout layout = Layout::kV4;
  int page_size = 64;  // tokens per page
  int64_t num_pages = 0;
  int num_layers = 1;
};

struct PoolStats {
  std::string name;
  std::string tenant;        // the owner's name; empty for the default tenant
  std::string device;
  uint64_t pool_id = 0;      // the incarnation: new for every CreatePool
  Layout layout = Layout::kV4;
  int page_size = 0;
  int64_t num_pages = 0;
  int num_layers = 0;
  int64_t page_bytes = 0;    // one page of one layer
  int64_t pool_bytes = 0;
  int64_t pages_used = 0;    // allocated, plus freed pages still being zeroed
  int64_t pages_free = 0;    // ready for AllocatePages
  int64_t tokens_held = 0;   // slots of allocated pages written in at least one layer
  int64_t records_held = 0;  // (slot, layer) records written
  Savings savings;           // bytes/token and the fractions saved (format.h)
  double bytes_saved_vs_bf16 = 0;  // records_held * (1024 - effective bytes/token)
  double bytes_saved_vs_v4 = 0;    // records_held * (V4 effective - effective bytes/token)
};

// Every pool and the daemon-wide totals.
struct DaemonStats {
  std::vector<PoolStats> pools;  // by name
  int64_t tokens_held = 0;
  int64_t records_held = 0;
  double bytes_saved_vs_bf16 = 0;
  double bytes_saved_vs_v4 = 0;
  int64_t pool_bytes = 0;
};

// Receives the wall time of each device op (metrics); may be null.
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  virtual void RecordOp(const char* op, Layout layout, double seconds) = 0;
};

}  // namespace kvferry::server
