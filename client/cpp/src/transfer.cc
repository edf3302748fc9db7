// Push and Pull of the C++ client (kvferry.v1.Transfer): pages between two daemons.
#include "client_impl.h"

namespace kvferry::client {
namespace {

Client::TransferResult FromProto(const v1::TransferPagesResponse& r) {
  return Client::TransferResult{r.pages(), r.bytes(), r.seconds(), r.transport()};
}

}  // namespace

absl::StatusOr<Client::TransferResult> Client::Push(const std::string& pool,
                                                    std::span<const PageHandle> pages,
                                                    const PeerPages& to,
                                                    std::span<const uint32_t> layers,
                                                    std::optional<Layout> transcode_to,
                                                    CallOptions call) {
  v1::PushRequest req;
  req.set_pool(pool);
  Pack(pages, req.mutable_page_list());
  req.mutable_layers()->Add(layers.begin(), layers.end());
  if (transcode_to) req.set_transcode_to(internal::ToProto(*transcode_to));
  req.set_to_address(to.address);
  req.set_to_pool(to.pool);
  Pack(to.pages, req.mutable_to_page_list());
  v1::TransferPagesResponse resp;
  KVF_CLIENT_RETURN(impl_->UnaryOn(*impl_->transfer, &v1::Transfer::Stub::Push, req, &resp, call));
  return FromProto(resp);
}

absl::StatusOr<Client::TransferResult> Client::Pull(const PeerPages& from, const std::string& pool,
                                                    std::span<const PageHandle> pages,
                                                    std::span<const uint32_t> layers,
                                                    std::optional<Layout> transcode_to,
                                                    CallOptions call) {
  v1::PullRequest req;
  req.set_from_address(from.address);
  req.set_from_pool(from.pool);
  Pack(from.pages, req.mutable_from_page_list());
  req.mutable_layers()->Add(layers.begin(), layers.end());
  if (transcode_to) req.set_transcode_to(internal::ToProto(*transcode_to));
  req.set_pool(pool);
  Pack(pages, req.mutable_page_list());
  v1::TransferPagesResponse resp;
  KVF_CLIENT_RETURN(impl_->UnaryOn(*impl_->transfer, &v1::Transfer::Stub::Pull, req, &resp, call));
  return FromProto(resp);
}

}  // namespace kvferry::client
