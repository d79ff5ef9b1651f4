// The in-process communicator group: the ranks are threads of one process, every collective a
// host rendezvous of all ranks followed by copies (memcpy, or cudaMemcpyAsync ordered by events).
//
// A collective runs two rendezvous. In the first every rank posts its send buffers and an event
// recorded after the work that wrote them; each rank then makes its stream wait for its source's
// event and copies the data into its own receive buffers. In the second every rank posts an
// event recorded after those copies, and each rank makes its stream wait for the copies out of its
// own send buffers: its later work (which may overwrite them) stays behind them, as with NCCL,
// whose operations complete when the transfer does. Events are reused from one call to the next:
// a rank records an event again only after a rendezvous that every rank reaches after its waits
// on the previous record were enqueued.
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "attnkit/context_parallel.h"
#include "core/check.h"
#include "cp/device_ops.h"

namespace attnkit::cp {
namespace {

struct Post {
  std::vector<RingTransfer> transfers;  // ring_exchange
  const void* send = nullptr;           // all_gather
  int64_t bytes = 0;
  const detail::DeviceEvent* event = nullptr;
};

// All ranks deposit a Post and read everyone's: a barrier with a payload. Generation g uses
// slot g % 2; a rank can deposit for g + 2 only after g + 1 completed, which needs every rank to
// have read g, so two slots suffice.
class Rendezvous {
 public:
  Rendezvous(int32_t world_size, double timeout_seconds)
      : world_size_(world_size), timeout_(timeout_seconds) {
    for (auto& slot : posts_) slot.resize(static_cast<size_t>(world_size));
  }

  std::vector<Post> exchange(int32_t rank, Post mine, int64_t generation) {
    std::unique_lock<std::mutex> lock(mutex_);
    ATTNKIT_CHECK(!failed_, "in-process communicator: the group failed earlier (", failure_,
                  "); create a new one");
    auto& slot = posts_[generation % 2];
    slot[rank] = std::move(mine);
    if (++arrived_[generation % 2] == world_size_) {
      arrived_[generation % 2] = 0;
      completed_ = generation;
      cv_.notify_all();
    } else {
      const bool done =
          cv_.wait_for(lock, timeout_, [&] { return completed_ >= generation || failed_; });
      if (!done) {
        failed_ = true;
        failure_ = "rank " + std::to_string(rank) + " waited " +
                   std::to_string(static_cast<int64_t>(timeout_.count())) +
                   " s for the other ranks to call the same collective";
        cv_.notify_all();
      }
      ATTNKIT_CHECK(!failed_, "in-process communicator: ", failure_);
    }
    return slot;
  }

 private:
  const int32_t world_size_;
  const std::chrono::duration<double> timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Post> posts_[2];
  int32_t arrived_[2] = {0, 0};
  int64_t completed_ = -1;
  bool failed_ = false;
  std::string failure_;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Rendezvous> rendezvous, std::vector<Device> devices,
                        int32_t rank)
      : rendezvous_(std::move(rendezvous)),
        devices_(std::move(devices)),
        rank_(rank),
        ready_(devices_[rank]),
        copied_(devices_[rank]),
        comm_stream_(devices_[rank]) {}

  int32_t rank() const override { return rank_; }
  int32_t world_size() const override { return static_cast<int32_t>(devices_.size()); }
  Device device() const override { return devices_[rank_]; }
  Stream comm_stream() const override { return comm_stream_.get(); }

  void ring_exchange(std::span<const RingTransfer> transfers, Stream stream) override {
    const int32_t r = world_size();
    ready_.record(stream);
    Post mine;
    mine.transfers.assign(transfers.begin(), transfers.end());
    mine.event = &ready_;
    const std::vector<Post> posts = rendezvous_->exchange(rank_, std::move(mine), generation_++);
    // Every rank checks every (sender, receiver) pair, so a mismatch throws on all of them.
    for (int32_t q = 0; q < r; ++q) {
      const Post& from = posts[q];
      const Post& to = posts[(q + 1) % r];
      ATTNKIT_CHECK(from.transfers.size() == to.transfers.size(), "ring_exchange: rank ", q,
                    " sends ", from.transfers.size(), " buffers but rank ", (q + 1) % r,
                    " receives ", to.transfers.size());
      for (size_t i = 0; i < from.transfers.size(); ++i) {
        ATTNKIT_CHECK(from.transfers[i].send_bytes == to.transfers[i].recv_bytes,
                      "ring_exchange: transfer ", i, ": rank ", q, " sends ",
                      from.transfers[i].send_bytes, " bytes but rank ", (q + 1) % r, " receives ",
                      to.transfers[i].recv_bytes);
      }
    }
    const Post& source = posts[(rank_ + r - 1) % r];
    source.event->make_wait(stream, device());
    for (size_t i = 0; i < transfers.size(); ++i) {
      detail::copy_bytes(device(), transfers[i].recv, source.transfers[i].send,
                         transfers[i].recv_bytes, stream);
    }
    finish({(rank_ + 1) % r}, stream);
  }

  void all_gather(const void* send, void* recv, int64_t bytes, Stream stream) override {
    const int32_t r = world_size();
    ready_.record(stream);
    Post mine;
    mine.send = send;
    mine.bytes = bytes;
    mine.event = &ready_;
    const std::vector<Post> posts = rendezvous_->exchange(rank_, std::move(mine), generation_++);
    for (int32_t q = 0; q < r; ++q) {
      ATTNKIT_CHECK(posts[q].bytes == posts[0].bytes, "all_gather: rank ", q, " sends ",
                    posts[q].bytes, " bytes but rank 0 sends ", posts[0].bytes);
    }
    std::vector<int32_t> readers;
    for (int32_t q = 0; q < r; ++q) {
      posts[q].event->make_wait(stream, device());
      detail::copy_bytes(device(), static_cast<uint8_t*>(recv) + q * bytes, posts[q].send, bytes,
                         stream);
      readers.push_back(q);
    }
    finish(readers, stream);
  }

 private:
  // The second rendezvous: `stream` waits for the copies that `readers` made of this rank's data.
  void finish(const std::vector<int32_t>& readers, Stream stream) {
    copied_.record(stream);
    Post mine;
    mine.event = &copied_;
    const std::vector<Post> posts = rendezvous_->exchange(rank_, std::move(mine), generation_++);
    for (const int32_t q : readers) {
      if (q != rank_) posts[q].event->make_wait(stream, device());
    }
  }

  std::shared_ptr<Rendezvous> rendezvous_;
  std::vector<Device> devices_;
  int32_t rank_;
  int64_t generation_ = 0;
  detail::DeviceEvent ready_, copied_;
  detail::OwnedStream comm_stream_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_group(std::span<const Device> devices,
                                                                 double timeout_seconds) {
  ATTNKIT_CHECK(!devices.empty(), "make_in_process_group: devices must name at least one rank");
  ATTNKIT_CHECK(timeout_seconds > 0, "make_in_process_group: timeout_seconds must be > 0, got ",
                timeout_seconds);
  const bool cpu = devices[0].is_cpu();
  for (size_t i = 0; i < devices.size(); ++i) {
    ATTNKIT_CHECK(devices[i].is_cpu() == cpu, "make_in_process_group: devices[", i, "] is ",
                  devices[i].str(), " but devices[0] is ", devices[0].str(),
                  "; a group is all cpu or all cuda");
  }
  const auto rendezvous =
      std::make_shared<Rendezvous>(static_cast<int32_t>(devices.size()), timeout_seconds);
  const std::vector<Device> all(devices.begin(), devices.end());
  std::vector<std::unique_ptr<Communicator>> group;
  for (size_t i = 0; i < devices.size(); ++i) {
    group.push_back(
        std::make_unique<InProcessCommunicator>(rendezvous, all, static_cast<int32_t>(i)));
  }
  return group;
}

}  // namespace attnkit::cp
