// Proto messages ↔ core types, with the wire's field rules (enum values, widths).
#pragma once

#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "core/types.h"
#include "kvferry/v1/kvferry.pb.h"

namespace kvferry::server {

// LAYOUT_UNSPECIFIED and unknown values are INVALID_ARGUMENT (INVALID_LAYOUT).
absl::StatusOr<Layout> FromProto(v1::Layout layout);
v1::Layout ToProto(Layout layout);
// LAYOUT_UNSPECIFIED means "no transcode".
absl::StatusOr<std::optional<Layout>> TranscodeFromProto(v1::Layout layout);

PageHandle FromProto(const v1::PageHandle& handle);
void ToProto(const PageHandle& handle, v1::PageHandle* out);
std::vector<PageHandle> FromProto(const google::protobuf::RepeatedPtrField<v1::PageHandle>& pages);
// A list of pages given as handles or packed (one of the two; `has_list` says the packed
// one was set): INVALID_ARGUMENT (INVALID_REQUEST) for both, or for packed arrays of two
// lengths. `side` names the list in the message ("destination").
absl::StatusOr<std::vector<PageHandle>> PagesFromProto(
    const google::protobuf::RepeatedPtrField<v1::PageHandle>& handles, bool has_list,
    const v1::PageList& list, const char* side);
// `pages` packed.
void PackPages(std::span<const PageHandle> pages, v1::PageList* out);
std::vector<TokenLocation> FromProto(
    const google::protobuf::RepeatedPtrField<v1::TokenLocation>& locations);

absl::StatusOr<PoolConfig> FromProto(const v1::CreatePoolRequest& request);
void ToProto(const PoolStats& stats, v1::Pool* out);
void ToProto(const PoolStats& stats, v1::PoolStats* out);
void ToProto(const DaemonStats& stats, v1::Stats* out);

}  // namespace kvferry::server
