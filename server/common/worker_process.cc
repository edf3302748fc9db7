#include "common/worker_process.h"

#include <errno.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errors.h"

namespace kvferry::server {

absl::StatusOr<std::unique_ptr<WorkerProcess>> WorkerProcess::Open(uint32_t pid) {
  const int pidfd = pid == 0 ? -1 : static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (pidfd < 0) {
    const int e = pid == 0 ? ESRCH : errno;
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kWorkerNotAccessible,
                 absl::StrCat("cannot open worker process ", pid, " (pidfd_open: ", std::strerror(e),
                              "): it must run in kvferryd's PID namespace, under that number"));
  }
  return std::unique_ptr<WorkerProcess>(new WorkerProcess(pidfd, pid));
}

WorkerProcess::~WorkerProcess() { close(pidfd_); }

absl::StatusOr<int> WorkerProcess::TakeFd(int fd) const {
  const int taken = fd < 0 ? -1 : static_cast<int>(syscall(SYS_pidfd_getfd, pidfd_, fd, 0));
  if (taken >= 0) return taken;
  const int e = fd < 0 ? EBADF : errno;
  if (e == EBADF) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("worker process ", pid_, " has no descriptor ", fd));
  }
  return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kWorkerNotAccessible,
               absl::StrCat("cannot take descriptor ", fd, " of worker process ", pid_,
                            " (pidfd_getfd: ", std::strerror(e), ")",
                            e == EPERM ? ": kvferryd needs ptrace access to the worker (the same "
                                         "user, Yama ptrace_scope 0 or CAP_SYS_PTRACE)"
                                       : ""));
}

absl::Status WorkerProcess::Proves(int fd, const std::string& secret) const {
  absl::StatusOr<int> taken = TakeFd(fd);
  if (!taken.ok()) return taken.status();
  // Only memory is read: a descriptor of a file elsewhere (FUSE, NFS, a device) could make
  // the read wait for as long as the worker likes, holding this handler's thread.
  struct statfs fs;
  if (fstatfs(*taken, &fs) != 0 ||
      (fs.f_type != TMPFS_MAGIC && fs.f_type != HUGETLBFS_MAGIC)) {
    close(*taken);
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kWorkerNotAccessible,
                 absl::StrCat("descriptor ", fd, " of worker process ", pid_,
                              " is not memory (a memfd or a tmpfs file): it cannot prove the "
                              "process belongs to this session"));
  }
  std::string got(secret.size() + 1, '\0');
  const ssize_t n = pread(*taken, got.data(), got.size(), 0);
  close(*taken);
  unsigned char diff = n == static_cast<ssize_t>(secret.size()) ? 0 : 1;
  for (size_t i = 0; i < secret.size(); ++i) {
    diff |= static_cast<unsigned char>(got[i] ^ secret[i]);  // no early exit
  }
  if (secret.empty() || diff != 0) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kWorkerNotAccessible,
                 absl::StrCat("worker process ", pid_, " did not prove it belongs to this session ",
                              "(its descriptor ", fd, " does not hold the session's secret)"));
  }
  return absl::OkStatus();
}

}  // namespace kvferry::server
