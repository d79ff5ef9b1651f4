// The few device operations the context-parallel drivers and the in-process transport need
// (memory, copies, events, streams), for CPU and CUDA devices alike. CPU: host memory, memcpy,
// and events / streams that do nothing (every CPU call is synchronous). CUDA: the runtime calls of
// src/cuda/cp/device_ops_cuda.cc (src/cp/device_ops_no_cuda.cc without CUDA, which throws).
#pragma once

#include <cstdint>

#include "attnkit/types.h"

namespace attnkit::cp::detail {

using Stream = void*;

// The CUDA side (device ordinals, streams as void*).
namespace cuda_ops {
void* malloc_async(int device, int64_t bytes, Stream stream);
void free_async(int device, void* data, Stream stream);  // never throws
void* event_create(int device);
void event_destroy(int device, void* event);  // never throws
void event_record(int device, void* event, Stream stream);
void stream_wait_event(int device, Stream stream, void* event);
void copy_async(int device, void* dst, const void* src, int64_t bytes, Stream stream);
// Host values reach the device through kernel parameters (no staging buffer to keep alive, and
// capturable in a CUDA graph).
void upload_int32_async(int device, const int32_t* host, int64_t count, int32_t* dst,
                        Stream stream);
Stream stream_create(int device);
void stream_destroy(int device, Stream stream);  // never throws
}  // namespace cuda_ops

// Scratch memory of one call, freed in stream order (cudaFreeAsync on the stream it was taken
// on) when the buffer goes out of scope.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const Device& device, int64_t bytes, Stream stream);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;

  uint8_t* data() const { return data_; }

 private:
  Device device_{};
  uint8_t* data_ = nullptr;
  Stream stream_ = nullptr;
};

// A CUDA event (timing off); every member is a no-op on the CPU.
class DeviceEvent {
 public:
  explicit DeviceEvent(const Device& device);
  ~DeviceEvent();
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;

  void record(Stream stream);
  // `stream` (of any device) waits for the work before the latest record().
  void make_wait(Stream stream, const Device& stream_device) const;

 private:
  Device device_;
  void* event_ = nullptr;
};

// dst <- src, bytes; CPU: memcpy now; CUDA: cudaMemcpyAsync (any devices, UVA) on `stream` of
// `device`.
void copy_bytes(const Device& device, void* dst, const void* src, int64_t bytes, Stream stream);

// dst[0, count) <- host[0, count) on `stream`; CPU: memcpy now.
void upload_int32(const Device& device, const int32_t* host, int64_t count, int32_t* dst,
                  Stream stream);

// An owned stream of a CUDA device (non-blocking); nullptr for the CPU.
class OwnedStream {
 public:
  explicit OwnedStream(const Device& device);
  ~OwnedStream();
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  Stream get() const { return stream_; }

 private:
  Device device_;
  Stream stream_ = nullptr;
};

}  // namespace attnkit::cp::detail
