// UcxWorker: one UCX context, a worker and a progress thread per lane, tagged messages
// between daemons.
#include "transport/ucx_worker.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/log.h"
#include "kvferry/kernels/cpu_thread_pool.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/mutex.h"
#include "kvferry/thread_name.h"

namespace kvferry::server {
namespace {

absl::Status UcxError(absl::string_view what, ucs_status_t status) {
  return Error(absl::StatusCode::kUnavailable, ErrorReason::kPeerUnavailable,
               absl::StrCat(what, ": ", ucs_status_string(status)));
}

// The requests of one transfer's sends or receives, and their outcome.
struct Group {
  std::mutex mu;
  std::condition_variable cv;
  int64_t inflight = 0;   // requests posted and not complete
  int64_t completed = 0;  // requests completed (progress, for the idle timer)
  absl::Status error;     // the first failure
  bool abandoned = false; // nobody waits: cancelled receives are not errors any more; sends:
                          // their memory goes with the last to end
  bool releasing = false; // receives: abandoned, all ended, and keep_alive taken to be dropped
  bool released = false;  // receives: ... and dropped
  int lanes = 1;          // receives: message i is posted on lane i % lanes
  std::vector<void*> requests;            // receives: by message index, null once complete
  std::vector<size_t> expected;           // receives: bytes of each message
  std::vector<int64_t> arrived;           // receives: messages that arrived whole, in order
  std::vector<std::vector<ucp_dt_iov_t>> iovs;  // receives: where each message lands
  std::shared_ptr<void> keep_alive;       // the memory, until UCX can touch it no more
  std::vector<char> sent;                 // sends: by message index, complete
  int64_t sent_prefix = 0;                // sends: the first this many are complete

  // A send completed (under the lock).
  void MarkSent(int64_t index) {
    if (static_cast<int64_t>(sent.size()) <= index) sent.resize(index + 1, 0);
    sent[index] = 1;
    while (sent_prefix < static_cast<int64_t>(sent.size()) && sent[sent_prefix]) ++sent_prefix;
  }

  void Fail(absl::Status s) {
    if (error.ok()) error = std::move(s);
  }
  // Receives: drops the memory taken from keep_alive, then says so (`released`). In that
  // order: a waiter in Abandon may hold the other reference.
  void Release(std::shared_ptr<void> memory) {
    memory.reset();
    {
      std::lock_guard lock(mu);
      released = true;
    }
    cv.notify_all();
  }
  // Waits until no request is in flight, an error, `cancelled`, or `idle` without progress.
  absl::Status Wait(absl::Duration idle, const UcxWorker::CancelCheck& cancelled,
                    absl::string_view what) {
    return WaitFor([this] { return inflight == 0; }, idle, cancelled, what);
  }
  // The same until `done()` (called under the lock).
  template <typename Done>
  absl::Status WaitFor(Done done, absl::Duration idle, const UcxWorker::CancelCheck& cancelled,
                       absl::string_view what) {
    std::unique_lock lock(mu);
    int64_t seen = completed;
    absl::Time deadline = absl::Now() + idle;
    while (!done() && error.ok()) {
      cv.wait_for(lock, std::chrono::milliseconds(50));
      if (completed != seen) {
        seen = completed;
        deadline = absl::Now() + idle;
      }
      if (done() || !error.ok()) break;
      if (cancelled && cancelled()) {
        return Error(absl::StatusCode::kCancelled, ErrorReason::kClientCancelled,
                     absl::StrCat(what, " cancelled"));
      }
      if (absl::Now() > deadline) {
        return Error(absl::StatusCode::kUnavailable, ErrorReason::kPeerUnavailable,
                     absl::StrCat(what, ": nothing completed for ", absl::FormatDuration(idle),
                                  "; the peer is gone or stopped answering"));
      }
    }
    return error;
  }
};

// Says what memory a request's buffer is, so that UCX need not look it up.
void SetMemoryType(ucp_request_param_t& param, bool on_device) {
  param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  param.memory_type = on_device ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
}

// Passes a block's registration, so that UCX need not find or make one.
void SetMemh(ucp_request_param_t& param, ucp_mem_h memh) {
  if (memh == nullptr) return;
  param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
  param.memh = memh;
}

// Memory that a UCX callback lets go of last (an abandoned transfer's: a write's rollback,
// which zeroes pages on the device; a deleted pool's memory and its UCX registration) must
// not end inside UCX's callback, where UCX still holds the request: the callback hands the
// drop here, and its lane's progress loop runs it once the UCX call returned (Loop). On any
// other thread it runs at once.
thread_local std::vector<std::function<void()>>* t_after_callbacks = nullptr;

void AfterCallbacks(std::function<void()> fn) {
  if (t_after_callbacks != nullptr) {
    t_after_callbacks->push_back(std::move(fn));
  } else {
    fn();
  }
}

// Runs what callbacks handed over (AfterCallbacks), including what those drops hand over.
void RunAfterCallbacks(std::vector<std::function<void()>>& after) {
  while (!after.empty()) {
    std::vector<std::function<void()>> now;
    now.swap(after);
    for (std::function<void()>& fn : now) fn();
  }
}

// What a UCX callback gets as user data: its group and the message index.
struct RequestContext {
  std::shared_ptr<Group> group;
  int64_t index = 0;
};

void OnReceive(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
               void* user_data) {
  std::unique_ptr<RequestContext> ctx(static_cast<RequestContext*>(user_data));
  Group& g = *ctx->group;
  std::shared_ptr<void> release;  // dropped outside the lock
  bool last = false;
  {
    std::lock_guard lock(g.mu);
    if (status == UCS_OK && info->length != g.expected[ctx->index]) {
      g.Fail(Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                   absl::StrCat("message ", ctx->index, " carried ", info->length,
                                " bytes, expected ", g.expected[ctx->index])));
    } else if (status != UCS_OK && !(status == UCS_ERR_CANCELED && g.abandoned)) {
      g.Fail(UcxError(absl::StrCat("receive of message ", ctx->index), status));
    } else if (status == UCS_OK) {
      g.arrived.push_back(ctx->index);
    }
    g.requests[ctx->index] = nullptr;
    --g.inflight;
    ++g.completed;
    if (g.inflight == 0 && g.abandoned && !g.releasing) {
      g.releasing = true;
      release = std::move(g.keep_alive);
      last = true;
    }
  }
  g.cv.notify_all();
  ucp_request_free(request);
  if (!last) return;
  // The memory's owner must end on this lane's thread after the callback (AfterCallbacks).
  AfterCallbacks([group = ctx->group, release = std::move(release)]() mutable {
    group->Release(std::move(release));
  });
}

void OnSend(void* request, ucs_status_t status, void* user_data) {
  std::unique_ptr<RequestContext> ctx(static_cast<RequestContext*>(user_data));
  Group& g = *ctx->group;
  std::shared_ptr<void> release;  // an abandoned transfer's memory, dropped outside the lock
  {
    std::lock_guard lock(g.mu);
    if (status != UCS_OK) g.Fail(UcxError("send to the peer", status));
    --g.inflight;
    ++g.completed;
    g.MarkSent(ctx->index);
    if (g.inflight == 0 && g.abandoned) release = std::move(g.keep_alive);
  }
  g.cv.notify_all();
  ucp_request_free(request);
  if (release != nullptr) AfterCallbacks([release = std::move(release)]() mutable { release.reset(); });
}

// Progress thread of `lane`: marks the group abandoned and cancels its receives still posted
// on that lane. A cancel completes its request at once, in its callback, which takes the
// group's lock: the requests are collected first and cancelled outside it.
void CancelReceives(ucp_worker_h worker, Group& g, int lane) {
  std::vector<void*> posted;
  {
    std::lock_guard lock(g.mu);
    g.abandoned = true;
    for (size_t i = static_cast<size_t>(lane); i < g.requests.size();
         i += static_cast<size_t>(g.lanes)) {
      if (g.requests[i] != nullptr) posted.push_back(g.requests[i]);
    }
  }
  for (void* r : posted) ucp_request_cancel(worker, r);
}

// After every lane cancelled its receives: once no receive is in flight, drops the group's
// hold on the memory (otherwise the last receive to end drops it, OnReceive, and says so).
void ReleaseIfEnded(Group& g) {
  std::shared_ptr<void> release;
  {
    std::lock_guard lock(g.mu);
    // Taken already: by the last receive's callback, which says so once it dropped it.
    if (g.inflight != 0 || g.releasing) return;
    g.releasing = true;
    release = std::move(g.keep_alive);
  }
  g.Release(std::move(release));
}

// The transport resources the context selected, as UCX prints them ("resource 3 : md 2 dev 1
// flags -- rc_mlx5/mlx5_0:1"; UCX_TLS applied).
std::string ContextResources(ucp_context_h context) {
  char* text = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&text, &size);
  if (out == nullptr) return "";
  ucp_context_print_info(context, out);
  std::fclose(out);
  std::string resources(text, size);
  std::free(text);
  return resources;
}

// Whether an RDMA transport the context selected runs on a NIC whose memory domain registers
// GPU memory (GPUDirect RDMA: the NIC reads and writes the GPU's memory itself).
bool GpuDirectRdma(const std::string& resources) {
  uct_component_h* components = nullptr;
  unsigned num_components = 0;
  if (uct_query_components(&components, &num_components) != UCS_OK) return false;
  bool found = false;
  for (unsigned c = 0; c < num_components && !found; ++c) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    if (std::string(attr.name) != "ib" || attr.md_resource_count == 0) continue;
    std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    attr.md_resources = mds.data();
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    for (const uct_md_resource_desc_t& md_desc : mds) {
      const std::string dev = absl::StrCat("/", md_desc.md_name, ":");
      bool selected = false;
      for (const char* tl : {"rc_", "dc_", "ud_"}) {
        for (size_t at = resources.find(tl); at != std::string::npos && !selected;
             at = resources.find(tl, at + 1)) {
          const size_t slash = resources.find('/', at);
          selected = slash != std::string::npos && resources.compare(slash, dev.size(), dev) == 0;
        }
      }
      if (!selected) continue;
      uct_md_config_t* config = nullptr;
      if (uct_md_config_read(components[c], nullptr, nullptr, &config) != UCS_OK) continue;
      uct_md_h md = nullptr;
      if (uct_md_open(components[c], md_desc.md_name, config, &md) == UCS_OK) {
        uct_md_attr_t md_attr{};
        if (uct_md_query(md, &md_attr) == UCS_OK &&
            (md_attr.cap.reg_mem_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0) {
          found = true;
        }
        uct_md_close(md);
      }
      uct_config_release(config);
      if (found) break;
    }
  }
  uct_release_component_list(components);
  return found;
}

// The kernel's boot id: the same for every process of one machine.
std::string HostId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

}  // namespace

// ---- registrations -------------------------------------------------------------------------

// Blocks registered with the context (ucp_mem_map), by base address: one registration serves
// every lane's worker. Mapped on a progress thread at a block's first use, unmapped on the
// thread that frees the block (Released) or when the worker ends; the context is created
// thread-safe for that (mt_workers_shared).
class UcxWorker::Registry final : public ReleaseListener {
 public:
  explicit Registry(ucp_context_h context) : context_(context) {}

  // The registration of the block `data` lies in, made now if it is the block's first use;
  // null without a block, or where UCX refuses one (the request then registers as before).
  ucp_mem_h Get(const MemoryBlock& block, const void* data, size_t bytes, bool on_device) {
    const auto* base = static_cast<const uint8_t*>(block.base);
    const auto* at = static_cast<const uint8_t*>(data);
    if (base == nullptr || at < base || at + bytes > base + block.bytes) return nullptr;
    const ucs_memory_type_t type = on_device ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    kvferry::MutexLock lock(&mu_);
    if (context_ == nullptr) return nullptr;
    if (auto it = blocks_.find(base); it != blocks_.end()) {
      if (it->second.bytes == block.bytes && it->second.type == type) return it->second.memh;
      Unmap(it);  // another block at that address: the old one is gone
    }
    ucp_mem_map_params_t params{};
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.address = const_cast<uint8_t*>(base);
    params.length = block.bytes;
    params.memory_type = type;
    ucp_mem_h memh = nullptr;
    if (ucs_status_t s = ucp_mem_map(context_, &params, &memh); s != UCS_OK) {
      log::Warn("ucx: registering a block of {} bytes: {}; its requests register themselves",
                block.bytes, ucs_status_string(s));
      return nullptr;
    }
    blocks_.emplace(base, Block{block.bytes, type, memh});
    bytes_ += block.bytes;
    return memh;
  }

  void Released(void* base) override {
    kvferry::MutexLock lock(&mu_);
    if (auto it = blocks_.find(static_cast<const uint8_t*>(base)); it != blocks_.end()) Unmap(it);
  }

  // Unmaps every block; later calls register nothing (the context is about to end).
  void Close() {
    kvferry::MutexLock lock(&mu_);
    while (!blocks_.empty()) Unmap(blocks_.begin());
    context_ = nullptr;
  }

  UcxWorker::Registrations Counts() {
    kvferry::MutexLock lock(&mu_);
    return {static_cast<int64_t>(blocks_.size()), bytes_};
  }

 private:
  struct Block {
    size_t bytes;
    ucs_memory_type_t type;
    ucp_mem_h memh;
  };
  using Map = absl::flat_hash_map<const uint8_t*, Block>;

  void Unmap(Map::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ucs_status_t s = ucp_mem_unmap(context_, it->second.memh); s != UCS_OK) {
      log::Warn("ucx: releasing a block's registration: {}", ucs_status_string(s));
    }
    bytes_ -= it->second.bytes;
    blocks_.erase(it);
  }

  kvferry::Mutex mu_;
  ucp_context_h context_ ABSL_GUARDED_BY(mu_);
  Map blocks_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

std::shared_ptr<ReleaseListener> UcxWorker::release_listener() const { return registry_; }

UcxWorker::Registrations UcxWorker::registrations() const { return registry_->Counts(); }

// ---- state shared by the public methods and the progress thread ----------------------------

struct Endpoint {
  ucp_ep_h ep = nullptr;  // null once closed
  std::string address;
  absl::Status error;     // set by the error handler (progress thread)
  // Senders on it that have not ended or been abandoned: every transfer to a peer shares its
  // endpoint, so a retired one closes only when none is left (Connect adds, the sender takes
  // itself off).
  std::atomic<int> senders{0};
};

struct UcxWorker::State {
  int lane = 0;
  ucp_worker_h worker = nullptr;
  int event_fd = -1;  // the worker's
  int wake_fd = -1;   // eventfd: a task was queued
  int epoll_fd = -1;

  std::mutex mu;
  std::deque<std::function<void()>> queue;
  bool stop = false;

  // Progress thread only.
  absl::flat_hash_map<std::string, std::shared_ptr<Endpoint>> endpoints;
  struct Closing {
    void* request;
    std::shared_ptr<Endpoint> endpoint;
  };
  std::vector<Closing> closing;
  std::vector<std::shared_ptr<Group>> receives;  // groups with receives posted
  // Endpoints of abandoned transfers: no new transfer uses them. Each is closed when the
  // other transfers on it have ended and the abandoned ones' sends have (the peer answered
  // or failed), or by force once those others have ended and the deadline (the last
  // abandonment plus the grace) has passed; at once when the peer failed.
  struct Retiring {
    std::shared_ptr<Endpoint> endpoint;
    std::vector<std::shared_ptr<Group>> groups;  // the abandoned transfers' sends
    absl::Time deadline;
  };
  std::vector<Retiring> retiring;
  absl::Duration abandon_grace = absl::Seconds(5);

  void Post(std::function<void()> task) {
    {
      std::lock_guard lock(mu);
      queue.push_back(std::move(task));
    }
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd, &one, sizeof(one));
  }
  // Runs `fn` on the progress thread and returns its result.
  template <typename Fn>
  auto Call(Fn fn) -> decltype(fn()) {
    std::packaged_task<decltype(fn())()> task(std::move(fn));
    auto result = task.get_future();
    Post([&task] { task(); });
    return result.get();
  }

  // Progress thread: frees the endpoint closes UCX finished, forgets receive groups with
  // nothing in flight.
  void Reap() {
    std::erase_if(closing, [](const Closing& c) {
      if (ucp_request_check_status(c.request) == UCS_INPROGRESS) return false;
      ucp_request_free(c.request);
      return true;
    });
    std::erase_if(receives, [](const std::shared_ptr<Group>& g) {
      std::lock_guard lock(g->mu);
      return g->inflight == 0;
    });
  }

  // Progress thread: an abandoned transfer's endpoint leaves the cache now and closes later
  // (RetireEnded).
  void Retire(const std::shared_ptr<Endpoint>& e, std::shared_ptr<Group> group) {
    if (e->ep == nullptr) return;
    Forget(e);
    const absl::Time deadline = absl::Now() + abandon_grace;
    for (Retiring& r : retiring) {
      if (r.endpoint == e) {
        r.groups.push_back(std::move(group));
        r.deadline = deadline;
        return;
      }
    }
    retiring.push_back({e, {std::move(group)}, deadline});
  }
  // Progress thread: new transfers to the peer no longer get `e`.
  void Forget(const std::shared_ptr<Endpoint>& e) {
    if (auto it = endpoints.find(e->address); it != endpoints.end() && it->second == e) {
      endpoints.erase(it);
    }
  }
  // Progress thread: closes the retired endpoints whose sends ended, and by force those past
  // their deadline. UCX 1.13's tcp transport can crash on bytes a peer sends to an endpoint
  // closed by force while its transfer was under way (a frozen peer that wakes up), so an
  // endpoint is forced only when its peer stayed silent for the whole grace time.
  void RetireEnded() {
    const absl::Time now = absl::Now();
    std::erase_if(retiring, [&](const Retiring& r) {
      const bool failed = !r.endpoint->error.ok();
      if (!failed && r.endpoint->senders.load() > 0) return false;  // others still use it
      bool ended = true;
      for (const std::shared_ptr<Group>& g : r.groups) {
        std::lock_guard lock(g->mu);
        ended = ended && g->inflight == 0;
      }
      if (!ended && !failed && now < r.deadline) return false;
      Close(r.endpoint, /*force=*/!ended || failed);
      return true;
    });
  }

  // Progress thread: closes the endpoint and forgets it. By force, every request on it
  // completes at once (with an error if unfinished); otherwise once they end.
  void Close(const std::shared_ptr<Endpoint>& e, bool force = true) {
    if (e->ep == nullptr) return;
    Forget(e);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* request = ucp_ep_close_nbx(e->ep, &param);
    e->ep = nullptr;
    if (UCS_PTR_IS_PTR(request)) closing.push_back({request, e});
  }

};

namespace {

void OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* e = static_cast<Endpoint*>(arg);
  if (e->error.ok()) e->error = UcxError(absl::StrCat("connection to the peer"), status);
  log::Warn("ucx: peer endpoint failed: {}", ucs_status_string(status));
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const UcxOptions& options) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return UcxError("ucp_config_read", s);
  }
  if (!options.transports.empty()) {
    if (ucs_status_t s = ucp_config_modify(config, "TLS", options.transports.c_str());
        s != UCS_OK) {
      ucp_config_release(config);
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat("UCX transports '", options.transports,
                                "': ", ucs_status_string(s)));
    }
  }
  if (!options.net_devices.empty()) {
    if (ucs_status_t s = ucp_config_modify(config, "NET_DEVICES", options.net_devices.c_str());
        s != UCS_OK) {
      ucp_config_release(config);
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat("UCX network devices '", options.net_devices,
                                "': ", ucs_status_string(s)));
    }
  }
  if (options.keepalive > absl::ZeroDuration() &&
      std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    const std::string interval =
        absl::StrCat(absl::ToInt64Microseconds(options.keepalive), "us");
    if (ucs_status_t s = ucp_config_modify(config, "KEEPALIVE_INTERVAL", interval.c_str());
        s != UCS_OK) {
      log::Warn("ucx: keepalive interval {} not taken: {}", interval, ucs_status_string(s));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  // Registrations are released on the thread that frees their block (Registry).
  params.mt_workers_shared = 1;
  ucp_context_h context = nullptr;
  ucs_status_t s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) return UcxError("ucp_init", s);
  w->context_ = context;  // from here on, ~UcxWorker cleans up what was made
  const int lanes = options.lanes > 0 ? std::min(options.lanes, kMaxUcxLanes)
                                      : UcxAutoLanes(cpu::DefaultThreadCount());
  for (int lane = 0; lane < lanes; ++lane) {
    auto state = std::make_shared<State>();
    state->lane = lane;
    if (options.abandon_grace > absl::ZeroDuration()) state->abandon_grace = options.abandon_grace;
    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;  // only its progress thread touches it
    if (s = ucp_worker_create(context, &wparams, &state->worker); s != UCS_OK) {
      return UcxError("ucp_worker_create", s);
    }
    w->lanes_.push_back(state);
    ucp_address_t* address = nullptr;
    size_t length = 0;
    if (s = ucp_worker_get_address(state->worker, &address, &length); s != UCS_OK) {
      return UcxError("ucp_worker_get_address", s);
    }
    w->addresses_.emplace_back(reinterpret_cast<const char*>(address), length);
    ucp_worker_release_address(state->worker, address);
    if (s = ucp_worker_get_efd(state->worker, &state->event_fd); s != UCS_OK) {
      return UcxError("ucp_worker_get_efd", s);
    }
    state->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    state->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (state->wake_fd < 0 || state->epoll_fd < 0) {
      return Error(absl::StatusCode::kUnavailable, ErrorReason::kTransportUnavailable,
                   absl::StrCat("ucx: no event fd for a progress thread: ", std::strerror(errno)));
    }
    for (int fd : {state->event_fd, state->wake_fd}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      epoll_ctl(state->epoll_fd, EPOLL_CTL_ADD, fd, &ev);
    }
  }
  const char* env = std::getenv("UCX_TLS");
  w->transports_ = !options.transports.empty() ? options.transports
                   : env != nullptr             ? std::string(env)
                                                : std::string("default");
  // Device memory goes to UCX only where its context says it moves CUDA memory, and then
  // only to peers that one of its transports reaches without the host.
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (!options.device.empty() && ucp_context_query(context, &attr) == UCS_OK &&
      (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0) {
    w->device_memory_ = options.device;
    const std::string resources = ContextResources(context);
    w->cuda_ipc_ = resources.find(" cuda_ipc/") != std::string::npos;
    w->gpudirect_rdma_ = GpuDirectRdma(resources);
    log::Info("ucx: {} memory moves directly to peers on this host: {}, to other hosts: {}",
              options.device, w->cuda_ipc_ ? "yes (cuda_ipc)" : "no",
              w->gpudirect_rdma_ ? "yes (GPUDirect RDMA)" : "no");
  }
  w->host_ = HostId();
  w->registry_ = std::make_shared<Registry>(context);
  for (const std::shared_ptr<State>& lane : w->lanes_) {
    w->threads_.emplace_back([state = lane.get(), bind = options.bind_device,
                              name = "kvf-ucx-" + std::to_string(w->threads_.size())] {
      NameThisThread(name);
      if (bind) bind();
      Loop(*state);
    });
  }
  return w;
}

UcxWorker::~UcxWorker() {
  for (size_t j = 0; j < threads_.size(); ++j) {
    State& st = *lanes_[j];
    {
      std::lock_guard lock(st.mu);
      st.stop = true;
    }
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(st.wake_fd, &one, sizeof(one));
  }
  for (std::thread& t : threads_) t.join();
  // Every request has ended; the backends' blocks outlive the context.
  if (registry_ != nullptr) registry_->Close();
  for (const std::shared_ptr<State>& st : lanes_) {
    ucp_worker_destroy(st->worker);
    if (st->epoll_fd >= 0) close(st->epoll_fd);
    if (st->wake_fd >= 0) close(st->wake_fd);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
}

void UcxWorker::Loop(State& st) {
  std::vector<std::function<void()>> after;
  t_after_callbacks = &after;
  for (;;) {
    std::deque<std::function<void()>> tasks;
    bool stop = false;
    {
      std::lock_guard lock(st.mu);
      tasks.swap(st.queue);
      stop = st.stop;
    }
    for (auto& task : tasks) task();
    while (ucp_worker_progress(st.worker) != 0) {
      RunAfterCallbacks(after);  // a busy lane drops abandoned memory as it goes
    }
    st.Reap();
    st.RetireEnded();
    RunAfterCallbacks(after);
    if (stop) {
      // Cancel what is still posted, close every endpoint, and progress until UCX is done.
      for (const auto& g : st.receives) CancelReceives(st.worker, *g, st.lane);
      std::vector<std::shared_ptr<Endpoint>> open;
      for (auto& [address, e] : st.endpoints) open.push_back(e);
      for (auto& r : st.retiring) open.push_back(r.endpoint);
      st.retiring.clear();
      for (auto& e : open) st.Close(e);
      const absl::Time give_up = absl::Now() + absl::Seconds(5);
      while ((!st.closing.empty() || !st.receives.empty()) && absl::Now() < give_up) {
        ucp_worker_progress(st.worker);
        st.Reap();
        RunAfterCallbacks(after);
      }
      RunAfterCallbacks(after);
      t_after_callbacks = nullptr;
      return;
    }
    // Endpoints the error handler marked: close them (their requests complete in error).
    std::vector<std::shared_ptr<Endpoint>> failed;
    for (auto& [address, e] : st.endpoints) {
      if (!e->error.ok()) failed.push_back(e);
    }
    for (auto& e : failed) st.Close(e);
    RunAfterCallbacks(after);
    {
      std::lock_guard lock(st.mu);
      if (!st.queue.empty() || st.stop) continue;
    }
    if (ucp_worker_arm(st.worker) == UCS_ERR_BUSY) continue;
    epoll_event events[4];
    // Closing endpoints need a few more rounds of progress; otherwise sleep until woken.
    epoll_wait(st.epoll_fd, events, 4, st.closing.empty() && st.retiring.empty() ? 1000 : 10);
    uint64_t drained = 0;
    [[maybe_unused]] ssize_t n = read(st.wake_fd, &drained, sizeof(drained));
  }
}

// ---- receives ------------------------------------------------------------------------------

namespace {

class ReceivesImpl final : public UcxWorker::Receives {
 public:
  // `lanes`: the states of the lanes the receives were posted on, lane 0 first.
  ReceivesImpl(std::vector<std::shared_ptr<UcxWorker::State>> lanes, std::shared_ptr<Group> group)
      : lanes_(std::move(lanes)), group_(std::move(group)) {}
  ~ReceivesImpl() override {
    // Cancel what is still posted; the group keeps the memory until every receive ended.
    CancelAll();
  }
  absl::Status Wait(absl::Duration idle, const UcxWorker::CancelCheck& cancelled) override {
    return group_->Wait(idle, cancelled, "receiving pages from the peer");
  }
  absl::StatusOr<std::vector<int64_t>> WaitArrived(absl::Duration idle,
                                                   const UcxWorker::CancelCheck& cancelled) override {
    Group& g = *group_;
    KVF_RETURN_IF_ERROR(g.WaitFor([&] { return g.arrived.size() > reported_ || g.inflight == 0; },
                                  idle, cancelled, "receiving pages from the peer"));
    std::lock_guard lock(g.mu);
    std::vector<int64_t> out(g.arrived.begin() + static_cast<ptrdiff_t>(reported_), g.arrived.end());
    reported_ = g.arrived.size();
    return out;
  }
  bool Abandon(absl::Duration bound) override {
    CancelAll();
    std::shared_ptr<Group> group = group_;
    std::unique_lock lock(group->mu);
    return group->cv.wait_for(lock, absl::ToChronoNanoseconds(bound),
                              [&] { return group->released; });
  }

 private:
  // Each lane cancels its receives on its own progress thread (where its callbacks run);
  // whoever sees the last receive end drops the memory (ReleaseIfEnded, OnReceive).
  void CancelAll() {
    std::shared_ptr<Group> group = group_;
    for (const std::shared_ptr<UcxWorker::State>& lane : lanes_) {
      lane->Call([&] {
        CancelReceives(lane->worker, *group, lane->lane);
        return 0;
      });
    }
    ReleaseIfEnded(*group);
    group->cv.notify_all();
  }

  std::vector<std::shared_ptr<UcxWorker::State>> lanes_;
  std::shared_ptr<Group> group_;
  size_t reported_ = 0;  // WaitArrived: messages of group_->arrived already returned
};

}  // namespace

absl::StatusOr<std::unique_ptr<UcxWorker::Receives>> UcxWorker::PostReceives(
    uint64_t tag_base, std::vector<std::vector<std::span<uint8_t>>> messages,
    std::shared_ptr<void> keep_alive, bool on_device, std::vector<MemoryBlock> blocks,
    int lanes) {
  if (lanes < 1 || lanes > this->lanes()) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 absl::StrCat("receives on ", lanes, " lanes; this daemon has ", this->lanes()));
  }
  auto group = std::make_shared<Group>();
  group->keep_alive = std::move(keep_alive);
  group->lanes = lanes;
  group->requests.assign(messages.size(), nullptr);
  for (const auto& pieces : messages) {
    std::vector<ucp_dt_iov_t> iov;
    size_t bytes = 0;
    for (std::span<uint8_t> p : pieces) {
      iov.push_back(ucp_dt_iov_t{p.data(), p.size()});
      bytes += p.size();
    }
    group->iovs.push_back(std::move(iov));
    group->expected.push_back(bytes);
  }
  std::vector<std::shared_ptr<State>> used(lanes_.begin(), lanes_.begin() + lanes);
  Registry& registry = *registry_;
  absl::Status posted = absl::OkStatus();
  for (const std::shared_ptr<State>& state : used) {
    posted = state->Call([&]() -> absl::Status {
      for (size_t i = static_cast<size_t>(state->lane); i < group->iovs.size();
           i += static_cast<size_t>(lanes)) {
        auto* ctx = new RequestContext{group, static_cast<int64_t>(i)};
        ucp_request_param_t param{};
        param.op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
        param.cb.recv = OnReceive;
        param.user_data = ctx;
        SetMemoryType(param, on_device);
        // One piece: a contiguous receive, which UCX's rendezvous moves zero-copy; several:
        // an I/O vector (UCX copies those through bounce buffers).
        const std::vector<ucp_dt_iov_t>& iov = group->iovs[i];
        const bool contiguous = iov.size() == 1;
        param.datatype = contiguous ? ucp_dt_make_contig(1) : ucp_dt_make_iov();
        if (contiguous && i < blocks.size()) {
          SetMemh(param, registry.Get(blocks[i], iov[0].buffer, iov[0].length, on_device));
        }
        void* request = contiguous
            ? ucp_tag_recv_nbx(state->worker, iov[0].buffer, iov[0].length, tag_base + i,
                               ~ucp_tag_t{0}, &param)
            : ucp_tag_recv_nbx(state->worker, group->iovs[i].data(), iov.size(), tag_base + i,
                               ~ucp_tag_t{0}, &param);
        if (UCS_PTR_IS_ERR(request)) {
          delete ctx;
          std::lock_guard lock(group->mu);
          group->Fail(UcxError("posting a receive", UCS_PTR_STATUS(request)));
          break;
        }
        if (request == nullptr) {
          // Complete at once: its message had come before the receive was posted, which no
          // sender following the protocol does (it sends after the ready). UCX 1.13 then says
          // nothing of the message's length, so the bytes cannot be trusted: the transfer
          // fails.
          delete ctx;
          std::lock_guard lock(group->mu);
          group->Fail(Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                            absl::StrCat("message ", i, " of the transfer came before its "
                                         "receive was posted (a peer that sent too early)")));
          ++group->completed;
          continue;
        }
        std::lock_guard lock(group->mu);
        group->requests[i] = request;
        ++group->inflight;
      }
      state->receives.push_back(group);
      std::lock_guard lock(group->mu);
      return group->error;
    });
    if (!posted.ok()) break;
  }
  auto receives = std::make_unique<ReceivesImpl>(std::move(used), group);
  if (!posted.ok()) return posted;  // ~ReceivesImpl cancels what was posted
  return receives;
}

// ---- sends ---------------------------------------------------------------------------------

namespace {

class SenderImpl final : public UcxWorker::Sender {
 public:
  // One lane of the sender: its state and its endpoint to the peer's lane of that number.
  struct Lane {
    std::shared_ptr<UcxWorker::State> state;
    std::shared_ptr<Endpoint> endpoint;
  };
  SenderImpl(std::shared_ptr<UcxWorker::Registry> registry, std::vector<Lane> lanes)
      : registry_(std::move(registry)), lanes_(std::move(lanes)),
        group_(std::make_shared<Group>()) {}

  absl::Status Post(uint64_t tag, std::span<const uint8_t> data, bool on_device,
                    MemoryBlock block) override {
    {
      std::lock_guard lock(group_->mu);
      KVF_RETURN_IF_ERROR(group_->error);
    }
    const int64_t index = posted_++;
    const Lane& lane = lanes_[static_cast<size_t>(index) % lanes_.size()];
    const std::shared_ptr<Endpoint>& endpoint = lane.endpoint;
    absl::Status posted = lane.state->Call([&]() -> absl::Status {
      if (endpoint->ep == nullptr || !endpoint->error.ok()) {
        return endpoint->error.ok()
                   ? Error(absl::StatusCode::kUnavailable, ErrorReason::kPeerUnavailable,
                           "the connection to the peer was closed")
                   : endpoint->error;
      }
      auto* ctx = new RequestContext{group_, index};
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = OnSend;
      param.user_data = ctx;
      SetMemoryType(param, on_device);
      SetMemh(param, registry_->Get(block, data.data(), data.size(), on_device));
      void* request = ucp_tag_send_nbx(endpoint->ep, data.data(), data.size(), tag, &param);
      if (request == nullptr) {
        delete ctx;
        std::lock_guard lock(group_->mu);
        group_->MarkSent(index);
        return absl::OkStatus();
      }
      if (UCS_PTR_IS_ERR(request)) {
        delete ctx;
        return UcxError("send to the peer", UCS_PTR_STATUS(request));
      }
      std::lock_guard lock(group_->mu);
      ++group_->inflight;
      return absl::OkStatus();
    });
    if (!posted.ok()) {
      std::lock_guard lock(group_->mu);
      group_->Fail(posted);
    }
    return posted;
  }

  absl::Status WaitThrough(int64_t messages, absl::Duration idle,
                           const UcxWorker::CancelCheck& cancelled) override {
    return group_->WaitFor([&] { return group_->sent_prefix >= messages; }, idle, cancelled,
                           "sending pages to the peer");
  }

  void Abandon(std::shared_ptr<void> memory) override {
    bool busy;
    {
      std::lock_guard lock(group_->mu);
      busy = group_->inflight > 0 || !group_->error.ok();
      if (group_->inflight > 0) {
        group_->abandoned = true;
        group_->keep_alive = std::move(memory);
      }
    }
    if (busy && !closed_) {
      closed_ = true;
      for (const Lane& lane : lanes_) {
        lane.state->Call([&] {
          lane.state->Retire(lane.endpoint, group_);
          return 0;
        });
      }
    }
    Leave();
  }

  // An owner that did not abandon a failed transfer: the endpoints are closed by force and
  // the sends waited for (a forced close completes them at once), since the memory they read
  // is about to go.
  ~SenderImpl() override {
    bool busy;
    {
      std::lock_guard lock(group_->mu);
      busy = group_->inflight > 0;
    }
    if (busy && !closed_) {
      for (const Lane& lane : lanes_) {
        lane.state->Call([&] {
          lane.state->Close(lane.endpoint);
          return 0;
        });
      }
      std::unique_lock lock(group_->mu);
      group_->cv.wait(lock, [&] { return group_->inflight == 0; });
    }
    Leave();
  }

 private:
  // This sender no longer uses its endpoints (Endpoint::senders).
  void Leave() {
    if (left_) return;
    left_ = true;
    for (const Lane& lane : lanes_) lane.endpoint->senders.fetch_sub(1);
  }

  std::shared_ptr<UcxWorker::Registry> registry_;
  std::vector<Lane> lanes_;
  std::shared_ptr<Group> group_;
  int64_t posted_ = 0;
  bool closed_ = false;
  bool left_ = false;
};

// Lane `state`'s endpoint to the worker at `address`: the cached one while it works, else a
// new one. Counts the caller among its senders.
absl::StatusOr<std::shared_ptr<Endpoint>> LaneEndpoint(UcxWorker::State& state,
                                                      const std::string& address) {
  return state.Call([&]() -> absl::StatusOr<std::shared_ptr<Endpoint>> {
    if (auto it = state.endpoints.find(address); it != state.endpoints.end()) {
      if (it->second->error.ok() && it->second->ep != nullptr) {
        it->second->senders.fetch_add(1);
        return it->second;
      }
      state.Close(it->second);
    }
    auto e = std::make_shared<Endpoint>();
    e->address = address;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = OnEndpointError;
    params.err_handler.arg = e.get();
    // Every endpoint reports its peer's failure, so that no request to a dead peer stays
    // in flight. UCX 1.13's posix and sysv transports cannot (their shared memory is
    // reached through tcp or cma then); with only those, the peer is unreachable.
    if (ucs_status_t s = ucp_ep_create(state.worker, &params, &e->ep); s != UCS_OK) {
      return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kTransportUnavailable,
                   absl::StrCat("connecting to the peer's UCX worker: ", ucs_status_string(s),
                                " (no transport of this daemon reaches the peer and reports "
                                "its failure; posix and sysv alone cannot: add cma or tcp)"));
    }
    e->senders.fetch_add(1);
    state.endpoints[address] = e;
    return e;
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxWorker::Sender>> UcxWorker::Connect(
    const std::vector<std::string>& addresses) {
  if (addresses.empty() || addresses.size() > lanes_.size()) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 absl::StrCat("a connection over ", addresses.size(), " lanes; this daemon has ",
                              lanes_.size()));
  }
  std::vector<SenderImpl::Lane> lanes;
  for (size_t j = 0; j < addresses.size(); ++j) {
    absl::StatusOr<std::shared_ptr<Endpoint>> endpoint = LaneEndpoint(*lanes_[j], addresses[j]);
    if (!endpoint.ok()) {
      for (const SenderImpl::Lane& lane : lanes) lane.endpoint->senders.fetch_sub(1);
      return endpoint.status();
    }
    lanes.push_back({lanes_[j], std::move(*endpoint)});
  }
  return std::make_unique<SenderImpl>(registry_, std::move(lanes));
}

}  // namespace kvferry::server
