// The service in process: an in-process gRPC server over the core, the error reason list
// against the proto's, status mapping, reason trailers on every error, read chunking, and
// a device failure seen through the API.
#include <grpcpp/grpcpp.h>
#include <xxhash.h>

#include "backend/cpu_backend.h"
#include "common/error_reason.h"
#include "common/errors.h"
#include "common/fault_backend.h"
#include "common/random_rows.h"
#include "gtest/gtest.h"
#include "kvferry/v1/errors.pb.h"
#include "service/pool_service.h"
#include "service/status.h"

namespace kvferry::server {
namespace {

TEST(ErrorReasonTest, TheCoreListEqualsTheProtoEnum) {
  const google::protobuf::EnumDescriptor* reasons = v1::ErrorReason_descriptor();
  int named = 0;
  for (int i = 0; i < kNumErrorReasons; ++i) {
    const google::protobuf::EnumValueDescriptor* value = reasons->FindValueByNumber(i);
    // Numbers the proto does not use have no name in the core either.
    EXPECT_EQ(value == nullptr ? std::string("ERROR_REASON_UNSPECIFIED") : value->name(),
              ReasonName(static_cast<ErrorReason>(i)))
        << i;
    if (value != nullptr) ++named;
  }
  EXPECT_EQ(reasons->value_count(), named) << "the proto has a reason past kNumErrorReasons";
}

TEST(ErrorReasonTest, TheInnermostReasonWinsAndCodesMapExplicitly) {
  const absl::Status inner = Error(absl::StatusCode::kInvalidArgument, ErrorReason::kNonFiniteValue, "x");
  EXPECT_EQ(ReasonOf(WithReason(inner, ErrorReason::kDeviceError)), ErrorReason::kNonFiniteValue);
  EXPECT_EQ(ReasonOf(WithReason(absl::InternalError("y"), ErrorReason::kDeviceError)),
            ErrorReason::kDeviceError);
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kUnknown), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kAborted), grpc::StatusCode::ABORTED);
  EXPECT_EQ(ToGrpcCode(absl::StatusCode::kUnauthenticated), grpc::StatusCode::UNAUTHENTICATED);
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fault_ = std::make_shared<testing::FaultBackend>(MakeCpuBackend());
    PoolManagerOptions options{"cpu", nullptr, {}, [this](const std::string&) {
                                 return absl::StatusOr<std::shared_ptr<Backend>>(fault_);
                               }};
    pools_ = std::make_unique<PoolManager>(options);
    ServiceOptions service_options;
    service_options.max_chunk_bytes = 4096;
    service_ = std::make_unique<KvFerryService>(pools_.get(), nullptr, service_options);
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    stub_ = v1::KvFerry::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
    v1::CreatePoolRequest req;
    req.set_name("p");
    req.set_layout(v1::LAYOUT_V41);
    req.set_page_size(16);
    req.set_num_pages(4);
    req.set_num_layers(2);
    grpc::ClientContext ctx;
    v1::Pool pool;
    ASSERT_TRUE(stub_->CreatePool(&ctx, req, &pool).ok());
    grpc::ClientContext actx;
    v1::AllocatePagesRequest areq;
    areq.set_pool("p");
    areq.set_count(2);
    v1::AllocatePagesResponse aresp;
    ASSERT_TRUE(stub_->AllocatePages(&actx, areq, &aresp).ok());
    pages_.assign(aresp.pages().begin(), aresp.pages().end());
  }
  void TearDown() override { server_->Shutdown(); }

  v1::TokenLocation Loc(int page, int slot) {
    v1::TokenLocation l;
    *l.mutable_page() = pages_[page];
    l.set_slot(slot);
    return l;
  }
  // One WriteTokens message; returns the status and the reason trailer.
  std::pair<grpc::Status, std::string> Write(const v1::WriteTokensRequest& msg) {
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = stub_->WriteTokens(&ctx, &resp);
    writer->Write(msg);
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    return {s, testing::ReasonOf(ctx)};
  }
  v1::WriteTokensRequest Rows(std::vector<v1::TokenLocation> where, uint64_t seed) {
    v1::WriteTokensRequest msg;
    msg.set_pool("p");
    for (auto& l : where) *msg.add_locations() = l;
    const auto rows = testing::RandomRows(static_cast<int64_t>(where.size()), seed);
    msg.set_rows(reinterpret_cast<const char*>(rows.data()), rows.size() * 2);
    msg.set_finish_write(true);  // the whole write
    return msg;
  }

  std::shared_ptr<testing::FaultBackend> fault_;
  std::unique_ptr<PoolManager> pools_;
  std::unique_ptr<KvFerryService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::KvFerry::Stub> stub_;
  std::vector<v1::PageHandle> pages_;
};

TEST_F(ServiceTest, EveryErrorCarriesAReasonTrailerNamingAnEnumValue) {
  v1::WriteTokensRequest bad_layer = Rows({Loc(0, 0)}, 1);
  bad_layer.set_layer(7);
  v1::WriteTokensRequest bad_slot = Rows({Loc(0, 99)}, 1);
  v1::WriteTokensRequest unknown_pool = Rows({Loc(0, 0)}, 1);
  unknown_pool.set_pool("nope");
  const std::vector<std::pair<v1::WriteTokensRequest, std::string>> cases = {
      {bad_layer, "LAYER_OUT_OF_RANGE"},
      {bad_slot, "SLOT_OUT_OF_RANGE"},
      {unknown_pool, "POOL_NOT_FOUND"},
  };
  for (const auto& [msg, reason] : cases) {
    auto [status, got] = Write(msg);
    EXPECT_FALSE(status.ok());
    EXPECT_EQ(got, reason);
    v1::ErrorReason parsed;
    EXPECT_TRUE(v1::ErrorReason_Parse(got, &parsed)) << got;
  }
  grpc::ClientContext ctx;
  v1::CreatePoolRequest req;
  req.set_name("q");
  v1::Pool pool;
  EXPECT_EQ(stub_->CreatePool(&ctx, req, &pool).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(testing::ReasonOf(ctx), "INVALID_LAYOUT");
}

TEST_F(ServiceTest, DeviceFailureAtCommitIsInternalWithDeviceErrorAndStoresNothing) {
  // Events of a one-message write: arena chunk, device staging, two copies, the op.
  fault_->FailAt(5);
  auto [status, reason] = Write(Rows({Loc(0, 0), Loc(1, 3)}, 2));
  fault_->FailAt(0);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL) << status.error_message();
  EXPECT_EQ(reason, "DEVICE_ERROR");
  grpc::ClientContext ctx;
  v1::Stats stats;
  ASSERT_TRUE(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.tokens_held(), 0u);
  EXPECT_TRUE(Write(Rows({Loc(0, 0), Loc(1, 3)}, 2)).first.ok());
}

TEST_F(ServiceTest, ReadsArriveInChunksOfTheRequestedSizeWithOffsetsAndHashes) {
  ASSERT_TRUE(Write(Rows({Loc(0, 0), Loc(1, 15)}, 3)).first.ok());
  grpc::ClientContext ctx;
  v1::ReadPagesRequest req;
  req.set_pool("p");
  for (const auto& p : pages_) *req.add_pages() = p;
  req.set_chunk_bytes(3000);
  auto reader = stub_->ReadPages(&ctx, req);
  v1::PageChunk chunk;
  uint64_t total = 0;
  int chunks = 0;
  while (reader->Read(&chunk)) {
    EXPECT_EQ(chunk.offset(), total);
    EXPECT_LE(chunk.data().size(), 3000u);
    EXPECT_EQ(chunk.xxh64(), XXH64(chunk.data().data(), chunk.data().size(), 0));
    EXPECT_EQ(chunk.page_bytes(), static_cast<uint64_t>(PageBytes(Layout::kV41, 16)));
    total += chunk.data().size();
    ++chunks;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(total, 2u * 2u * PageBytes(Layout::kV41, 16));
  // Batches of one page (8448 bytes), each sent as 3000 + 3000 + 2448.
  EXPECT_EQ(chunks, 4 * 3);
}

// Refuses every caller, as the token authenticator does a caller without a valid token.
class RefuseEveryone final : public Authenticator {
 public:
  absl::StatusOr<std::shared_ptr<TenantAccount>> Authenticate(
      const grpc::ServerContext&) const override {
    return Error(absl::StatusCode::kUnauthenticated, ErrorReason::kNotAuthenticated, "no token");
  }
};

TEST(ServiceAuthTest, ARefusedCallerGetsUnauthenticatedAndReachesNothing) {
  PoolManager pools(PoolManagerOptions{"cpu", nullptr, {}, nullptr});
  RefuseEveryone refuse;
  KvFerryService service(&pools, nullptr, ServiceOptions{}, &refuse);
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  auto stub = v1::KvFerry::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
  auto expect_refused = [](const grpc::Status& s, const grpc::ClientContext& ctx) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(testing::ReasonOf(ctx), "NOT_AUTHENTICATED");
  };
  {
    grpc::ClientContext ctx;
    v1::CreatePoolRequest req;
    req.set_name("p");
    req.set_layout(v1::LAYOUT_V4);
    req.set_page_size(16);
    req.set_num_pages(4);
    req.set_num_layers(1);
    v1::Pool out;
    const grpc::Status s = stub->CreatePool(&ctx, req, &out);
    expect_refused(s, ctx);
  }
  {
    grpc::ClientContext ctx;
    v1::Stats out;
    const grpc::Status s = stub->GetStats(&ctx, v1::GetStatsRequest(), &out);
    expect_refused(s, ctx);
  }
  {
    grpc::ClientContext ctx;
    v1::WriteResponse out;
    auto writer = stub->WriteTokens(&ctx, &out);
    v1::WriteTokensRequest msg;
    msg.set_pool("p");
    writer->Write(msg);
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    expect_refused(s, ctx);
  }
  EXPECT_TRUE(pools.List().empty());
  server->Shutdown();
}

}  // namespace
}  // namespace kvferry::server
