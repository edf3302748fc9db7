// WorkerProcess: descriptors of another process taken with pidfd_getfd, and the proof that a
// process belongs to a session (a descriptor reading the session's secret). The test
// process plays the worker (a process may always take its own descriptors).
#include "common/worker_process.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "common/errors.h"
#include "gtest/gtest.h"

namespace kvferry::server {
namespace {

int Memfd(const std::string& contents) {
  const int fd = memfd_create("worker-process-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, contents.data(), contents.size()), static_cast<ssize_t>(contents.size()));
  return fd;
}

const char* NameOf(const absl::Status& s) { return ReasonName(ReasonOf(s)); }

TEST(WorkerProcessTest, TakesDescriptorsAndChecksTheSecret) {
  auto self = WorkerProcess::Open(static_cast<uint32_t>(getpid()));
  if (!self.ok()) GTEST_SKIP() << "pidfd_open is not available here: " << self.status();
  const std::string secret(32, '\x5a');
  const int good = Memfd(secret);
  absl::StatusOr<int> taken = (*self)->TakeFd(good);
  if (!taken.ok() && ReasonOf(taken.status()) == ErrorReason::kWorkerNotAccessible) {
    close(good);
    GTEST_SKIP() << "pidfd_getfd is not permitted here: " << taken.status();
  }
  ASSERT_TRUE(taken.ok()) << taken.status();
  // The copy is the same open file: it reads what the original holds.
  char first = 0;
  EXPECT_EQ(pread(*taken, &first, 1, 0), 1);
  EXPECT_EQ(first, '\x5a');
  EXPECT_NE(*taken, good);
  close(*taken);

  EXPECT_TRUE((*self)->Proves(good, secret).ok());
  std::string other = secret;
  other[31] ^= 1;
  EXPECT_STREQ(NameOf((*self)->Proves(good, other)), "WORKER_NOT_ACCESSIBLE");  // a wrong byte
  const int longer = Memfd(secret + "x");
  EXPECT_STREQ(NameOf((*self)->Proves(longer, secret)), "WORKER_NOT_ACCESSIBLE");  // more bytes
  const int shorter = Memfd(secret.substr(0, 31));
  EXPECT_STREQ(NameOf((*self)->Proves(shorter, secret)), "WORKER_NOT_ACCESSIBLE");
  EXPECT_STREQ(NameOf((*self)->Proves(good, "")), "WORKER_NOT_ACCESSIBLE");  // no secret
  // Descriptors the worker does not have.
  EXPECT_STREQ(NameOf((*self)->TakeFd(-1).status()), "INVALID_REQUEST");
  EXPECT_STREQ(NameOf((*self)->TakeFd(1 << 20).status()), "INVALID_REQUEST");
  EXPECT_STREQ(NameOf((*self)->Proves(1 << 20, secret)), "INVALID_REQUEST");
  close(good);
  close(longer);
  close(shorter);
}

// A proof is read only from memory: the secret in a file on a disk file system (which a
// FUSE mount could make wait forever) or in a pipe does not count.
TEST(WorkerProcessTest, OnlyMemoryCanHoldTheProof) {
  auto self = WorkerProcess::Open(static_cast<uint32_t>(getpid()));
  if (!self.ok()) GTEST_SKIP() << "pidfd_open is not available here: " << self.status();
  const std::string secret(32, '\x33');
  const int memfd = Memfd(secret);
  const absl::Status with_memfd = (*self)->Proves(memfd, secret);
  close(memfd);
  if (!with_memfd.ok()) GTEST_SKIP() << "pidfd_getfd is not permitted here: " << with_memfd;
  // The test's working directory (the build tree) as the disk.
  const std::string path = "worker-process-test-proof";
  {
    std::ofstream(path) << secret;
  }
  const int file = open(path.c_str(), O_RDONLY);
  ASSERT_GE(file, 0);
  struct statfs fs;
  ASSERT_EQ(fstatfs(file, &fs), 0);
  if (fs.f_type != TMPFS_MAGIC) {
    const absl::Status s = (*self)->Proves(file, secret);
    EXPECT_STREQ(NameOf(s), "WORKER_NOT_ACCESSIBLE");
    EXPECT_NE(s.message().find("is not memory"), std::string::npos) << s;
  }
  close(file);
  unlink(path.c_str());
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ASSERT_EQ(write(pipe_fds[1], secret.data(), secret.size()), static_cast<ssize_t>(secret.size()));
  const absl::Status s = (*self)->Proves(pipe_fds[0], secret);
  EXPECT_STREQ(NameOf(s), "WORKER_NOT_ACCESSIBLE");
  EXPECT_NE(s.message().find("is not memory"), std::string::npos) << s;
  close(pipe_fds[0]);
  close(pipe_fds[1]);
}

TEST(WorkerProcessTest, AProcessThatIsNotThereIsNotAccessible) {
  EXPECT_STREQ(NameOf(WorkerProcess::Open(0x7FFFFFF0).status()), "WORKER_NOT_ACCESSIBLE");
  EXPECT_STREQ(NameOf(WorkerProcess::Open(0).status()), "WORKER_NOT_ACCESSIBLE");
}

}  // namespace
}  // namespace kvferry::server
