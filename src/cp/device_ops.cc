// Device operations of the context-parallel code: CPU here, CUDA through cuda_ops.
#include "cp/device_ops.h"

#include <cstring>
#include <new>
#include <utility>

#include "core/check.h"

namespace attnkit::cp::detail {

DeviceBuffer::DeviceBuffer(const Device& device, int64_t bytes, Stream stream)
    : device_(device), stream_(stream) {
  if (bytes <= 0) return;
  if (device.is_cpu()) {
    data_ = new (std::nothrow) uint8_t[static_cast<size_t>(bytes)];
    ATTNKIT_CHECK(data_ != nullptr, "context parallelism: could not allocate ", bytes,
                  " bytes of host scratch memory");
  } else {
    data_ = static_cast<uint8_t*>(cuda_ops::malloc_async(device.index, bytes, stream));
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ == nullptr) return;
  if (device_.is_cpu()) {
    delete[] data_;
  } else {
    cuda_ops::free_async(device_.index, data_, stream_);
  }
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  std::swap(device_, other.device_);
  std::swap(data_, other.data_);
  std::swap(stream_, other.stream_);
  return *this;
}

DeviceEvent::DeviceEvent(const Device& device) : device_(device) {
  if (device.is_cuda()) event_ = cuda_ops::event_create(device.index);
}

DeviceEvent::~DeviceEvent() {
  if (event_ != nullptr) cuda_ops::event_destroy(device_.index, event_);
}

void DeviceEvent::record(Stream stream) {
  if (event_ != nullptr) cuda_ops::event_record(device_.index, event_, stream);
}

void DeviceEvent::make_wait(Stream stream, const Device& stream_device) const {
  if (event_ != nullptr && stream_device.is_cuda()) {
    cuda_ops::stream_wait_event(stream_device.index, stream, event_);
  }
}

void copy_bytes(const Device& device, void* dst, const void* src, int64_t bytes, Stream stream) {
  if (bytes <= 0) return;
  if (device.is_cpu()) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
  } else {
    cuda_ops::copy_async(device.index, dst, src, bytes, stream);
  }
}

void upload_int32(const Device& device, const int32_t* host, int64_t count, int32_t* dst,
                  Stream stream) {
  if (count <= 0) return;
  if (device.is_cpu()) {
    std::memcpy(dst, host, static_cast<size_t>(count) * sizeof(int32_t));
  } else {
    cuda_ops::upload_int32_async(device.index, host, count, dst, stream);
  }
}

OwnedStream::OwnedStream(const Device& device) : device_(device) {
  if (device.is_cuda()) stream_ = cuda_ops::stream_create(device.index);
}

OwnedStream::~OwnedStream() {
  if (stream_ != nullptr) cuda_ops::stream_destroy(device_.index, stream_);
}

}  // namespace attnkit::cp::detail
