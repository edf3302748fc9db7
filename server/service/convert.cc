// Conversions between the v1 messages and the core's types.
#include "service/convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/errors.h"

namespace kvferry::server {

absl::StatusOr<Layout> FromProto(v1::Layout layout) {
  switch (layout) {
    case v1::LAYOUT_V4:
      return Layout::kV4;
    case v1::LAYOUT_V41:
      return Layout::kV41;
    case v1::LAYOUT_V41_FP4:
      return Layout::kV41Fp4;
    default:
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidLayout,
                   absl::StrCat("unknown layout ", static_cast<int>(layout),
                                ": expected LAYOUT_V4, LAYOUT_V41 or LAYOUT_V41_FP4"));
  }
}

v1::Layout ToProto(Layout layout) {
  switch (layout) {
    case Layout::kV4:
      return v1::LAYOUT_V4;
    case Layout::kV41:
      return v1::LAYOUT_V41;
    case Layout::kV41Fp4:
      return v1::LAYOUT_V41_FP4;
  }
  return v1::LAYOUT_UNSPECIFIED;
}

absl::StatusOr<std::optional<Layout>> TranscodeFromProto(v1::Layout layout) {
  if (layout == v1::LAYOUT_UNSPECIFIED) return std::optional<Layout>();
  absl::StatusOr<Layout> l = FromProto(layout);
  if (!l.ok()) return l.status();
  return std::optional<Layout>(*l);
}

PageHandle FromProto(const v1::PageHandle& h) { return PageHandle{h.page_id(), h.generation()}; }

void ToProto(const PageHandle& h, v1::PageHandle* out) {
  out->set_page_id(h.page_id);
  out->set_generation(h.generation);
}

std::vector<PageHandle> FromProto(const google::protobuf::RepeatedPtrField<v1::PageHandle>& pages) {
  std::vector<PageHandle> out;
  out.reserve(pages.size());
  for (const v1::PageHandle& h : pages) out.push_back(FromProto(h));
  return out;
}

absl::StatusOr<std::vector<PageHandle>> PagesFromProto(
    const google::protobuf::RepeatedPtrField<v1::PageHandle>& handles, bool has_list,
    const v1::PageList& list, const char* side) {
  if (!has_list) return FromProto(handles);
  if (!handles.empty()) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("give the ", side, " pages as handles or as a packed list, not both"));
  }
  if (list.page_ids_size() != list.generations_size()) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("the packed ", side, " page list has ", list.page_ids_size(),
                              " page ids and ", list.generations_size(), " generations"));
  }
  std::vector<PageHandle> pages(list.page_ids_size());
  const uint64_t* ids = list.page_ids().data();
  const uint64_t* generations = list.generations().data();
  for (size_t i = 0; i < pages.size(); ++i) pages[i] = {ids[i], generations[i]};
  return pages;
}

void PackPages(std::span<const PageHandle> pages, v1::PageList* out) {
  out->mutable_page_ids()->Reserve(static_cast<int>(pages.size()));
  out->mutable_generations()->Reserve(static_cast<int>(pages.size()));
  for (const PageHandle& p : pages) {
    out->add_page_ids(p.page_id);
    out->add_generations(p.generation);
  }
}

std::vector<TokenLocation> FromProto(
    const google::protobuf::RepeatedPtrField<v1::TokenLocation>& locations) {
  std::vector<TokenLocation> out(locations.size());
  for (int i = 0; i < locations.size(); ++i) {
    out[i] = TokenLocation{FromProto(locations[i].page()), locations[i].slot()};
  }
  return out;
}

absl::StatusOr<PoolConfig> FromProto(const v1::CreatePoolRequest& req) {
  absl::StatusOr<Layout> layout = FromProto(req.layout());
  if (!layout.ok()) return layout.status();
  // Wider-than-int fields saturate, so the core's range check reports them.
  return PoolConfig{req.name(), *layout,
                    static_cast<int>(std::min<uint32_t>(req.page_size(), 1u << 30)),
                    static_cast<int64_t>(std::min<uint64_t>(req.num_pages(), uint64_t{1} << 62)),
                    static_cast<int>(std::min<uint32_t>(req.num_layers(), 1u << 30))};
}

void ToProto(const PoolStats& s, v1::Pool* out) {
  out->set_name(s.name);
  out->set_layout(ToProto(s.layout));
  out->set_page_size(s.page_size);
  out->set_num_pages(s.num_pages);
  out->set_num_layers(s.num_layers);
  out->set_device(s.device);
  out->set_page_bytes(s.page_bytes);
  out->set_pool_bytes(s.pool_bytes);
  out->set_pages_used(s.pages_used);
  out->set_pages_free(s.pages_free);
  out->set_tokens_held(s.tokens_held);
  out->set_pool_id(s.pool_id);
}

void ToProto(const PoolStats& s, v1::PoolStats* p) {
  p->set_name(s.name);
  p->set_layout(ToProto(s.layout));
  p->set_page_size(s.page_size);
  p->set_pages_used(s.pages_used);
  p->set_pages_free(s.pages_free);
  p->set_tokens_held(s.tokens_held);
  p->set_records_held(s.records_held);
  p->set_nominal_bytes_per_token(s.savings.nominal_bytes_per_token);
  p->set_effective_bytes_per_token(s.savings.effective_bytes_per_token);
  p->set_bytes_saved_vs_bf16(s.bytes_saved_vs_bf16);
  p->set_bytes_saved_vs_v4(s.bytes_saved_vs_v4);
  p->set_pool_bytes(s.pool_bytes);
}

void ToProto(const DaemonStats& s, v1::Stats* out) {
  for (const PoolStats& p : s.pools) ToProto(p, out->add_pools());
  out->set_tokens_held(s.tokens_held);
  out->set_records_held(s.records_held);
  out->set_bytes_saved_vs_bf16(s.bytes_saved_vs_bf16);
  out->set_bytes_saved_vs_v4(s.bytes_saved_vs_v4);
  out->set_pool_bytes(s.pool_bytes);
}

}  // namespace kvferry::server
