// Descriptors of a worker process on this host, taken with pidfd_getfd (Linux 5.6): how
// kvferryd maps memory a worker allocated with CUDA's virtual memory API, whose handles are
// file descriptors. Taking them needs ptrace access to the worker (the same user, a PID
// namespace in common, and Yama's ptrace_scope 0 or CAP_SYS_PTRACE).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvferry::server {

// An open pidfd of a worker process; closed on destruction.
class WorkerProcess {
 public:
  // FAILED_PRECONDITION (WORKER_NOT_ACCESSIBLE) when there is no such process here.
  static absl::StatusOr<std::unique_ptr<WorkerProcess>> Open(uint32_t pid);
  ~WorkerProcess();
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // A copy of the worker's descriptor `fd`, owned by the caller (close it).
  // INVALID_ARGUMENT (INVALID_REQUEST) when the worker has no such descriptor,
  // FAILED_PRECONDITION (WORKER_NOT_ACCESSIBLE) when this process may not take it.
  absl::StatusOr<int> TakeFd(int fd) const;
  // Whether the worker's descriptor `fd` reads `secret` (its first secret.size() bytes, and
  // nothing after): the proof that the process is the one a session's owner controls, since
  // only that owner knows the session's secret. WORKER_NOT_ACCESSIBLE otherwise.
  absl::Status Proves(int fd, const std::string& secret) const;
  uint32_t pid() const { return pid_; }

 private:
  WorkerProcess(int pidfd, uint32_t pid) : pidfd_(pidfd), pid_(pid) {}
  const int pidfd_;
  const uint32_t pid_;
};

}  // namespace kvferry::server
