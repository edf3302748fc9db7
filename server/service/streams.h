// Stream plumbing shared by the services: telling a client's half-close from a message
// that did not decode, the status of a client that went away, and sending a reader's
// batches in bounded chunks.
#pragma once

#include <grpcpp/grpcpp.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <span>
#include <string>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "common/errors.h"
#include "core/reader.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {

// The client went away (cancelled or past its deadline): its staged work is dropped.
inline absl::Status ClientGone(grpc::ServerContext* context) {
  if (context->deadline() < std::chrono::system_clock::now()) {
    return Error(absl::StatusCode::kDeadlineExceeded, ErrorReason::kDeadlineExceeded,
                 "deadline exceeded; the work was dropped");
  }
  return Error(absl::StatusCode::kCancelled, ErrorReason::kClientCancelled,
               "client cancelled; the work was dropped");
}

inline std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// Reads the next message of a client stream. gRPC's Read answers false both when the
// client half-closed and when a message arrived that does not decode (a proto3 string that
// is not UTF-8, truncated bytes): a write must commit only in the first case. Decoding
// clears the message before it parses, and the end of the stream leaves it untouched, so a
// mark put into the message before the Read tells the two apart: still there, the client
// half-closed; gone, a message was lost. The mark is an unknown field with a value chosen
// per stream, so a decoded message cannot carry it by accident.
template <typename Request>
class StreamReader {
 public:
  explicit StreamReader(grpc::ServerReader<Request>* reader)
      : reader_(reader), mark_(absl::Uniform<uint64_t>(bitgen_)) {}

  // True with a message; false at the end of the stream, with `*undecodable` set when the
  // end is a message that could not be decoded rather than the client's half-close.
  bool Read(Request* msg, bool* undecodable) {
    msg->Clear();
    msg->GetReflection()->MutableUnknownFields(msg)->AddVarint(kMarkField, mark_);
    if (reader_->Read(msg)) return true;
    const auto& unknown = msg->GetReflection()->GetUnknownFields(*msg);
    *undecodable = !(unknown.field_count() == 1 && unknown.field(0).number() == kMarkField &&
                     unknown.field(0).type() == google::protobuf::UnknownField::TYPE_VARINT &&
                     unknown.field(0).varint() == mark_);
    return false;
  }

 private:
  static constexpr int kMarkField = 536870911;  // the largest field number protobuf allows
  grpc::ServerReader<Request>* reader_;
  absl::BitGen bitgen_;
  uint64_t mark_;
};

// The end of a client-streaming write. gRPC's Read also answers false when the stream was
// cancelled (the client's deadline, a reset, a lost connection), and IsCancelled() may learn
// of that only a moment later: a write cut off after some of its messages would then look
// complete. So the client marks its last message (finish_write), and a write is stored
// only when the stream's last message carried the mark.
class WriteEnd {
 public:
  // Each message, in order: refused after the one that finished the write.
  absl::Status Next(bool finish_write) {
    if (finished_) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   "a message came after the one that set finish_write; nothing was stored");
    }
    finished_ = finish_write;
    return absl::OkStatus();
  }
  // At the end of the stream: WRITE_NOT_FINISHED unless the last message finished it.
  absl::Status AtEnd() const {
    if (finished_) return absl::OkStatus();
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kWriteNotFinished,
                 "the stream ended without a message that sets finish_write, as a stream the "
                 "client cancelled or lost does; nothing was stored");
  }

 private:
  bool finished_ = false;
};

// Sends a reader's batches as messages of at most chunk_bytes; `fill` sets a message's
// position fields from the byte offset of its data; `sent` (optional) runs after each
// message went out (the stream watchdog's sign of progress).
template <typename Chunk>
absl::Status StreamRead(grpc::ServerContext* context, Reader& reader, int64_t chunk_bytes,
                        grpc::ServerWriter<Chunk>* writer,
                        const std::function<void(uint64_t offset, Chunk&)>& fill,
                        const std::function<std::string*(Chunk&)>& data,
                        const std::function<void()>& sent = nullptr) {
  uint64_t offset = 0;
  Chunk chunk;
  while (true) {
    KVF_ASSIGN_OR_RETURN(const std::span<const uint8_t> batch, reader.Next());
    if (batch.empty()) return absl::OkStatus();
    for (size_t at = 0; at < batch.size(); at += static_cast<size_t>(chunk_bytes)) {
      if (context->IsCancelled()) return ClientGone(context);
      const size_t n = std::min(batch.size() - at, static_cast<size_t>(chunk_bytes));
      fill(offset, chunk);
      data(chunk)->assign(reinterpret_cast<const char*>(batch.data() + at), n);
      chunk.set_xxh64(XXH64(batch.data() + at, n, 0));
      offset += n;
      if (!writer->Write(chunk)) return ClientGone(context);
      if (sent) sent();
    }
  }
}

}  // namespace kvferry::server
