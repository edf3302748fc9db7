// UcxWorker's registrations: one per memory block, made at the block's first use, reused by
// later messages in it, released when the block's backend frees it (or the worker ends).
// Two workers in one process over tcp on loopback; the bytes are checked against the
// pattern the sender wrote.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "gtest/gtest.h"
#include "transport/ucx_worker.h"

namespace kvferry::server {
namespace {

constexpr size_t kBlockBytes = size_t{1} << 20;
constexpr int kLanes = 3;

class UcxRegistrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    UcxOptions options;
    options.transports = "tcp";
    options.net_devices = "lo";
    options.abandon_grace = absl::Milliseconds(500);
    // Three lanes each: the single-lane transfers below use lane 0 (and the registrations,
    // one per block, serve every lane); the lane tests spread messages over all three.
    options.lanes = kLanes;
    for (auto* w : {&receiver_, &sender_}) {
      absl::StatusOr<std::unique_ptr<UcxWorker>> made = UcxWorker::Create(options);
      ASSERT_TRUE(made.ok()) << made.status();
      *w = std::move(*made);
    }
    for (auto* b : {&receiver_backend_, &sender_backend_}) {
      absl::StatusOr<std::shared_ptr<Backend>> made = MakeBackend("cpu");
      ASSERT_TRUE(made.ok()) << made.status();
      *b = std::move(*made);
    }
    receiver_backend_->set_release_listener(receiver_->release_listener());
    sender_backend_->set_release_listener(sender_->release_listener());
  }

  // On cpu, kDevice is host memory freed when released (as a pool's); kHostStaging is kept
  // by the backend for reuse.
  Buffer Block(Backend& backend, uint8_t seed, MemoryKind kind = MemoryKind::kDevice) {
    absl::StatusOr<Buffer> b = backend.Allocate(kBlockBytes, kind, false);
    EXPECT_TRUE(b.ok()) << b.status();
    for (size_t i = 0; i < kBlockBytes; ++i) b->get()[i] = static_cast<uint8_t>(seed + i * 7);
    return std::move(*b);
  }

  // Moves `bytes` from src+at to dst+at as one message, each side naming the given blocks.
  void Move(const Buffer& src, MemoryBlock src_block, const Buffer& dst, MemoryBlock dst_block,
            size_t at, size_t bytes) {
    const uint64_t tag = UcxTag(++transfer_, 0);
    std::vector<std::vector<std::span<uint8_t>>> messages = {{{dst.get() + at, bytes}}};
    absl::StatusOr<std::unique_ptr<UcxWorker::Receives>> receives = receiver_->PostReceives(
        tag, std::move(messages), nullptr, false, {dst_block});
    ASSERT_TRUE(receives.ok()) << receives.status();
    absl::StatusOr<std::unique_ptr<UcxWorker::Sender>> sender = sender_->Connect(receiver_->address());
    ASSERT_TRUE(sender.ok()) << sender.status();
    ASSERT_TRUE((*sender)->Post(tag, {src.get() + at, bytes}, false, src_block).ok());
    ASSERT_TRUE((*sender)->WaitThrough(1, absl::Seconds(10), nullptr).ok());
    ASSERT_TRUE((*receives)->Wait(absl::Seconds(10), nullptr).ok());
    ASSERT_EQ(std::memcmp(dst.get() + at, src.get() + at, bytes), 0);
  }

  // A sender that posted `src` whole as message `tag`, which nobody has received yet; its
  // wait for it has failed (null, the test failed, if any step went otherwise).
  std::unique_ptr<UcxWorker::Sender> SendUnanswered(uint64_t tag, const Buffer& src) {
    absl::StatusOr<std::unique_ptr<UcxWorker::Sender>> sender =
        sender_->Connect(receiver_->address());
    EXPECT_TRUE(sender.ok()) << sender.status();
    if (!sender.ok()) return nullptr;
    const absl::Status posted = (*sender)->Post(tag, {src.get(), kBlockBytes}, false, src.block());
    EXPECT_TRUE(posted.ok()) << posted;
    if (!posted.ok()) return nullptr;
    EXPECT_FALSE((*sender)->WaitThrough(1, absl::Milliseconds(100), nullptr).ok());
    return std::move(*sender);
  }

  // Receives message `tag` into the whole of `dst` and waits until it is in.
  void ReceiveWhole(uint64_t tag, const Buffer& dst) {
    std::vector<std::vector<std::span<uint8_t>>> messages = {{{dst.get(), kBlockBytes}}};
    absl::StatusOr<std::unique_ptr<UcxWorker::Receives>> receives =
        receiver_->PostReceives(tag, std::move(messages), nullptr, false, {dst.block()});
    ASSERT_TRUE(receives.ok()) << receives.status();
    const absl::Status in = (*receives)->Wait(absl::Seconds(10), nullptr);
    ASSERT_TRUE(in.ok()) << in;
  }

  std::unique_ptr<UcxWorker> receiver_, sender_;
  std::shared_ptr<Backend> receiver_backend_, sender_backend_;
  uint64_t transfer_ = 0;
};

TEST_F(UcxRegistrationTest, OneRegistrationPerBlockReusedAndReleasedWhenTheBlockIsFreed) {
  Buffer src = Block(*sender_backend_, 1);
  Buffer dst = Block(*receiver_backend_, 2);
  EXPECT_EQ(receiver_->registrations().blocks, 0);

  Move(src, src.block(), dst, dst.block(), 0, kBlockBytes);
  EXPECT_EQ(sender_->registrations().blocks, 1);
  EXPECT_EQ(sender_->registrations().bytes, src.bytes());
  EXPECT_EQ(receiver_->registrations().blocks, 1);
  EXPECT_EQ(receiver_->registrations().bytes, dst.bytes());

  // Later messages in the same blocks, whole or a part, reuse the registrations.
  for (uint8_t* p = src.get(); p < src.get() + kBlockBytes; ++p) *p ^= 0x5a;
  Move(src, src.block(), dst, dst.block(), 0, kBlockBytes);
  Move(src, src.block(), dst, dst.block(), 4096, 64 << 10);
  EXPECT_EQ(sender_->registrations().blocks, 1);
  EXPECT_EQ(receiver_->registrations().blocks, 1);

  // A block that does not hold the message is not registered; the message still moves.
  Buffer other = Block(*receiver_backend_, 3);
  Move(src, other.block(), dst, other.block(), 0, 4096);
  EXPECT_EQ(sender_->registrations().blocks, 1);
  EXPECT_EQ(receiver_->registrations().blocks, 1);

  // Freeing a block releases its registration, on that side only.
  dst.Reset();
  EXPECT_EQ(receiver_->registrations().blocks, 0);
  EXPECT_EQ(receiver_->registrations().bytes, 0u);
  EXPECT_EQ(sender_->registrations().blocks, 1);
  src.Reset();
  EXPECT_EQ(sender_->registrations().blocks, 0);
}

// A receiver that uses each message as it lands (a GPU pool's host staging, copied on to the
// device message by message) is told every message once, as it arrives whole, in whatever
// order the sender sent them, and then that there are no more.
TEST_F(UcxRegistrationTest, ArrivedMessagesAreReportedOnceEachAsTheyLand) {
  Buffer src = Block(*sender_backend_, 3);
  Buffer dst = Block(*receiver_backend_, 0);
  const size_t part = kBlockBytes / 4;
  const uint64_t tag = UcxTag(++transfer_, 0);
  std::vector<std::vector<std::span<uint8_t>>> messages;
  for (size_t i = 0; i < 4; ++i) messages.push_back({{dst.get() + i * part, part}});
  absl::StatusOr<std::unique_ptr<UcxWorker::Receives>> receives =
      receiver_->PostReceives(tag, std::move(messages), nullptr, false);
  ASSERT_TRUE(receives.ok()) << receives.status();
  absl::StatusOr<std::unique_ptr<UcxWorker::Sender>> sender = sender_->Connect(receiver_->address());
  ASSERT_TRUE(sender.ok()) << sender.status();
  for (const size_t i : {2, 0, 3}) {
    ASSERT_TRUE((*sender)->Post(tag + i, {src.get() + i * part, part}, false, src.block()).ok());
  }
  std::vector<int64_t> seen;
  while (seen.size() < 3) {
    absl::StatusOr<std::vector<int64_t>> arrived = (*receives)->WaitArrived(absl::Seconds(10), nullptr);
    ASSERT_TRUE(arrived.ok()) << arrived.status();
    ASSERT_FALSE(arrived->empty());
    for (const int64_t i : *arrived) {
      // Whole when reported.
      EXPECT_EQ(std::memcmp(dst.get() + i * part, src.get() + i * part, part), 0) << "message " << i;
      seen.push_back(i);
    }
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 2, 3}));
  // Message 1 not sent: nothing to report, and the wait ends at the idle bound.
  const absl::StatusOr<std::vector<int64_t>> idle =
      (*receives)->WaitArrived(absl::Milliseconds(200), nullptr);
  EXPECT_EQ(idle.status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE((*sender)->Post(tag + 1, {src.get() + part, part}, false, src.block()).ok());
  absl::StatusOr<std::vector<int64_t>> last = (*receives)->WaitArrived(absl::Seconds(10), nullptr);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(*last, (std::vector<int64_t>{1}));
  absl::StatusOr<std::vector<int64_t>> none = (*receives)->WaitArrived(absl::Seconds(10), nullptr);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  EXPECT_TRUE((*receives)->Wait(absl::Seconds(10), nullptr).ok());
  EXPECT_TRUE((*sender)->WaitThrough(4, absl::Seconds(10), nullptr).ok());
  EXPECT_EQ(std::memcmp(dst.get(), src.get(), kBlockBytes), 0);
}

TEST_F(UcxRegistrationTest, StagingKeptForReuseKeepsItsRegistration) {
  Buffer src = Block(*sender_backend_, 8);
  Buffer dst = Block(*receiver_backend_, 9, MemoryKind::kHostStaging);
  const uint8_t* first = dst.get();
  Move(src, src.block(), dst, dst.block(), 0, kBlockBytes);
  ASSERT_EQ(receiver_->registrations().blocks, 1);
  dst.Reset();  // back to the backend's spares: not freed, still registered
  EXPECT_EQ(receiver_->registrations().blocks, 1);
  dst = Block(*receiver_backend_, 10, MemoryKind::kHostStaging);
  ASSERT_EQ(dst.get(), first);  // the spare again
  Move(src, src.block(), dst, dst.block(), 0, kBlockBytes);
  EXPECT_EQ(receiver_->registrations().blocks, 1);
  EXPECT_EQ(receiver_->registrations().bytes, kBlockBytes);
}

TEST_F(UcxRegistrationTest, ABlockReusedAtTheSameAddressWithAnotherSizeIsRegisteredAgain) {
  Buffer src = Block(*sender_backend_, 4);
  Buffer dst = Block(*receiver_backend_, 5);
  Move(src, src.block(), dst, dst.block(), 0, 4096);
  // The receiver's block named smaller (as a reused allocation of another size would be):
  // the old registration goes, the new one covers what is named.
  Move(src, src.block(), dst, MemoryBlock{dst.get(), 8192}, 0, 4096);
  EXPECT_EQ(receiver_->registrations().blocks, 1);
  EXPECT_EQ(receiver_->registrations().bytes, 8192u);
}

TEST_F(UcxRegistrationTest, BlocksOutliveTheWorker) {
  Buffer src = Block(*sender_backend_, 6);
  Buffer dst = Block(*receiver_backend_, 7);
  Move(src, src.block(), dst, dst.block(), 0, kBlockBytes);
  ASSERT_EQ(receiver_->registrations().blocks, 1);
  // The worker ends first (it releases its registrations); freeing the block afterwards
  // tells a closed registry, which does nothing.
  std::shared_ptr<ReleaseListener> listener = receiver_->release_listener();
  receiver_.reset();
  dst.Reset();
  listener->Released(src.get());
}

// A transfer abandoned while its message is in flight (the receiver has posted nothing yet,
// as a frozen peer): ending the sender does not wait, the message's memory lives on, and
// when the receiver takes the message the bytes arrive whole and the memory is released.
// Unanswered, the endpoint is closed by force after the grace time and the memory goes then.
// Either way the next transfer to the peer gets a fresh endpoint and moves its bytes.
TEST_F(UcxRegistrationTest, AnAbandonedTransfersMemoryLivesUntilItsMessageEnds) {
  auto released = [](const std::weak_ptr<void>& memory) {
    for (auto until = absl::Now() + absl::Seconds(5); absl::Now() < until;
         absl::SleepFor(absl::Milliseconds(10))) {
      if (memory.expired()) return true;
    }
    return false;
  };
  for (const bool answered : {true, false}) {
    SCOPED_TRACE(answered ? "the receiver takes the message later" : "nobody answers");
    auto src = std::make_shared<Buffer>(Block(*sender_backend_, 8));
    Buffer dst = Block(*receiver_backend_, 9);
    std::vector<uint8_t> expected(src->get(), src->get() + kBlockBytes);
    const uint64_t tag = UcxTag(++transfer_, 0);
    std::unique_ptr<UcxWorker::Sender> sender = SendUnanswered(tag, *src);
    ASSERT_NE(sender, nullptr);
    std::weak_ptr<void> memory = src;
    const absl::Time start = absl::Now();
    sender->Abandon(std::move(src));
    sender.reset();
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(100)) << "ending the sender waited";
    EXPECT_FALSE(memory.expired());
    if (answered) {
      ReceiveWhole(tag, dst);
      EXPECT_EQ(std::memcmp(dst.get(), expected.data(), kBlockBytes), 0);
    }
    EXPECT_TRUE(released(memory));
    Buffer next = Block(*sender_backend_, 10);
    Move(next, next.block(), dst, dst.block(), 0, kBlockBytes);
  }
}

// A message that came before its receive was posted (a small one, sent eagerly: no sender
// following the protocol does this) completes that receive at once, without a callback and,
// in UCX 1.13, without its length: the receives fail at once rather than wait for a
// completion that never comes.
TEST_F(UcxRegistrationTest, AMessageThatCameBeforeItsReceiveFailsTheReceivesAtOnce) {
  Buffer src = Block(*sender_backend_, 16), dst = Block(*receiver_backend_, 17);
  constexpr size_t kSmall = 64;
  const uint64_t tag = UcxTag(++transfer_, 0);
  absl::StatusOr<std::unique_ptr<UcxWorker::Sender>> sender =
      sender_->Connect(receiver_->address());
  ASSERT_TRUE(sender.ok()) << sender.status();
  ASSERT_TRUE((*sender)->Post(tag, {src.get(), kSmall}, false, src.block()).ok());
  ASSERT_TRUE((*sender)->WaitThrough(1, absl::Seconds(10), nullptr).ok());
  absl::SleepFor(absl::Milliseconds(200));  // the message reaches the receiver's worker
  std::vector<std::vector<std::span<uint8_t>>> messages = {{{dst.get(), kSmall}}};
  absl::StatusOr<std::unique_ptr<UcxWorker::Receives>> receives =
      receiver_->PostReceives(tag, std::move(messages), nullptr, false, {dst.block()});
  EXPECT_EQ(receives.status().code(), absl::StatusCode::kInternal) << receives.status();
  EXPECT_NE(receives.status().message().find("came before its receive"), std::string::npos)
      << receives.status();
  // The worker serves the next transfer.
  Buffer next = Block(*sender_backend_, 18);
  Move(next, next.block(), dst, dst.block(), 0, kBlockBytes);
}

// Every transfer to a peer shares one endpoint: one abandoned transfer must not close it
// under another still running on it, neither when its message ends later (the endpoint then
// closed at once) nor when nobody answers it (then closed by force after the grace time).
TEST_F(UcxRegistrationTest, AnAbandonedTransferLeavesTheOtherTransfersOnItsEndpointAlone) {
  for (const bool answered : {true, false}) {
    SCOPED_TRACE(answered ? "the receiver takes the abandoned message later" : "nobody answers");
    absl::StatusOr<std::unique_ptr<UcxWorker::Sender>> other =
        sender_->Connect(receiver_->address());
    ASSERT_TRUE(other.ok()) << other.status();
    // The abandoned transfer, on the same endpoint.
    auto src = std::make_shared<Buffer>(Block(*sender_backend_, 11));
    Buffer dst = Block(*receiver_backend_, 12);
    const uint64_t tag = UcxTag(++transfer_, 0);
    {
      std::unique_ptr<UcxWorker::Sender> sender = SendUnanswered(tag, *src);
      ASSERT_NE(sender, nullptr);
      sender->Abandon(std::move(src));
    }
    if (answered) ReceiveWhole(tag, dst);
    absl::SleepFor(absl::Milliseconds(700));  // past the grace time (500 ms)
    // The other transfer goes on over the endpoint it has: its next message arrives whole.
    Buffer mine = Block(*sender_backend_, 13), there = Block(*receiver_backend_, 14);
    const uint64_t other_tag = UcxTag(++transfer_, 0);
    std::vector<std::vector<std::span<uint8_t>>> messages = {{{there.get(), kBlockBytes}}};
    absl::StatusOr<std::unique_ptr<UcxWorker::Receives>> receives =
        receiver_->PostReceives(other_tag, std::move(messages), nullptr, false, {there.block()});
    ASSERT_TRUE(receives.ok()) << receives.status();
    const absl::Status posted = (*other)->Post(other_tag, {mine.get(), kBlockBytes}, false,
                                               mine.block());
    ASSERT_TRUE(posted.ok()) << posted;
    ASSERT_TRUE((*other)->WaitThrough(1, absl::Seconds(10), nullptr).ok());
    ASSERT_TRUE((*receives)->Wait(absl::Seconds(10), nullptr).ok());
    EXPECT_EQ(std::memcmp(there.get(), mine.get(), kBlockBytes), 0);
    other->reset();
    // With no transfer left on it, the endpoint closes; new transfers get a new one.
    Buffer next = Block(*sender_backend_, 15);
    Move(next, next.block(), there, there.block(), 0, kBlockBytes);
  }
}

// A transfer over lanes: message i travels on lane i % lanes of both sides, each lane its own
// worker and connection. Seven messages over three lanes land whole, each where it was
// posted, and the blocks are registered once for all lanes.
TEST_F(UcxRegistrationTest, MessagesSpreadOverLanesLandWholeWhereTheyWerePosted) {
  ASSERT_EQ(receiver_->lanes(), kLanes);
  ASSERT_EQ(sender_->addresses().size(), static_cast<size_t>(kLanes));
  Buffer src = Block(*sender_backend_, 21);
  Buffer dst = Block(*receiver_backend_, 0);
  constexpr size_t kMessages = 7;
  const size_t part = kBlockBytes / 8;
  const uint64_t tag = UcxTag(++transfer_, 0);
  std::vector<std::vector<std::span<uint8_t>>> messages;
  // Message i lands in part 7 - i, so that a message landing as another would show.
  for (size_t i = 0; i < kMessages; ++i) messages.push_back({{dst.get() + (7 - i) * part, part}});
  absl::StatusOr<std::unique_ptr<UcxWorker::Receives>> receives = receiver_->PostReceives(
      tag, std::move(messages), nullptr, false, std::vector<MemoryBlock>(kMessages, dst.block()),
      kLanes);
  ASSERT_TRUE(receives.ok()) << receives.status();
  absl::StatusOr<std::unique_ptr<UcxWorker::Sender>> sender =
      sender_->Connect(receiver_->addresses());
  ASSERT_TRUE(sender.ok()) << sender.status();
  for (size_t i = 0; i < kMessages; ++i) {
    ASSERT_TRUE((*sender)->Post(tag + i, {src.get() + i * part, part}, false, src.block()).ok());
  }
  ASSERT_TRUE((*sender)->WaitThrough(kMessages, absl::Seconds(10), nullptr).ok());
  ASSERT_TRUE((*receives)->Wait(absl::Seconds(10), nullptr).ok());
  for (size_t i = 0; i < kMessages; ++i) {
    EXPECT_EQ(std::memcmp(dst.get() + (7 - i) * part, src.get() + i * part, part), 0)
        << "message " << i;
  }
  EXPECT_EQ(receiver_->registrations().blocks, 1);
  EXPECT_EQ(sender_->registrations().blocks, 1);
}

// The lanes are real: a sender connected to the receiver's lane 0 only (one lane) gets
// through the messages posted on lane 0 (0, 3, 6), never those the receiver expects on lanes
// 1 and 2; abandoning the receives then releases their memory, on every lane.
TEST_F(UcxRegistrationTest, AMessageOnlyLandsOnTheLaneItsReceiveWasPostedOn) {
  Buffer src = Block(*sender_backend_, 22);
  auto dst = std::make_shared<Buffer>(Block(*receiver_backend_, 0));
  const std::vector<uint8_t> before(dst->get(), dst->get() + kBlockBytes);
  const size_t part = kBlockBytes / 8;
  const uint64_t tag = UcxTag(++transfer_, 0);
  std::vector<std::vector<std::span<uint8_t>>> messages;
  for (size_t i = 0; i < 7; ++i) messages.push_back({{dst->get() + i * part, part}});
  std::weak_ptr<void> memory = dst;
  absl::StatusOr<std::unique_ptr<UcxWorker::Receives>> receives =
      receiver_->PostReceives(tag, std::move(messages), dst, false, {}, kLanes);
  ASSERT_TRUE(receives.ok()) << receives.status();
  absl::StatusOr<std::unique_ptr<UcxWorker::Sender>> sender =
      sender_->Connect(receiver_->address());
  ASSERT_TRUE(sender.ok()) << sender.status();
  for (const size_t i : {0, 3, 6}) {
    ASSERT_TRUE((*sender)->Post(tag + i, {src.get() + i * part, part}, false, src.block()).ok());
  }
  ASSERT_TRUE((*sender)->WaitThrough(3, absl::Seconds(10), nullptr).ok());
  std::vector<int64_t> seen;
  while (seen.size() < 3) {
    absl::StatusOr<std::vector<int64_t>> arrived =
        (*receives)->WaitArrived(absl::Seconds(10), nullptr);
    ASSERT_TRUE(arrived.ok()) << arrived.status();
    ASSERT_FALSE(arrived->empty());
    seen.insert(seen.end(), arrived->begin(), arrived->end());
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 3, 6}));
  // Messages 1, 2, 4, 5 were sent to lane 0 as well (tags of lanes 1 and 2): none lands.
  for (const size_t i : {1, 2, 4, 5}) {
    ASSERT_TRUE((*sender)->Post(tag + i, {src.get() + i * part, part}, false, src.block()).ok());
  }
  const absl::Status rest = (*receives)->Wait(absl::Milliseconds(300), nullptr);
  EXPECT_EQ(rest.code(), absl::StatusCode::kUnavailable) << rest;
  for (size_t i = 0; i < 7; ++i) {
    const bool sent_on_its_lane = i % kLanes == 0;
    EXPECT_EQ(std::memcmp(dst->get() + i * part,
                          (sent_on_its_lane ? src.get() : before.data()) + i * part, part), 0)
        << "part " << i;
  }
  dst.reset();
  EXPECT_FALSE(memory.expired());  // the receives still hold it
  EXPECT_TRUE((*receives)->Abandon(absl::Seconds(5)));
  EXPECT_TRUE(memory.expired());
  sender->reset();
}

// More lanes than the worker has, or none, are refused before anything is posted or
// connected.
TEST_F(UcxRegistrationTest, MoreLanesThanTheWorkerHasAreRefused) {
  Buffer dst = Block(*receiver_backend_, 0);
  std::vector<std::vector<std::span<uint8_t>>> messages = {{{dst.get(), 4096}}};
  for (const int lanes : {0, kLanes + 1}) {
    EXPECT_FALSE(receiver_->PostReceives(UcxTag(++transfer_, 0), messages, nullptr, false, {},
                                         lanes).ok());
  }
  std::vector<std::string> addresses = receiver_->addresses();
  addresses.push_back(addresses.front());
  EXPECT_FALSE(sender_->Connect(addresses).ok());
  EXPECT_FALSE(sender_->Connect(std::vector<std::string>{}).ok());
}

}  // namespace
}  // namespace kvferry::server
