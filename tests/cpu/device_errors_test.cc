// The host side of device-fault reporting (include/attnkit/device_errors.h, docs/safety.md): the
// messages of DeviceFaultError for every fault kind, check_device_errors() without a GPU, the
// ATTNKIT_CHECKED rule and the per-call `checked` flag on CPU calls.
#include "attnkit/device_errors.h"

#include <gtest/gtest.h>

#include <string>

#include "attnkit/attnkit.h"
#include "core/device_checks.h"
#include "validate_fixtures.h"

namespace attnkit::test {
namespace {

DeviceFault fault_of(FaultKind kind, Op op, FaultArg arg, int64_t row, int64_t index, int64_t value,
                     int64_t bound, unsigned long long count = 1) {
  DeviceFault f;
  f.state = 2;
  f.kind = static_cast<int32_t>(kind);
  f.op = static_cast<int32_t>(op);
  f.arg = static_cast<int32_t>(arg);
  f.row = row;
  f.index = index;
  f.value = value;
  f.bound = bound;
  f.count = count;
  return f;
}

TEST(DeviceFaultMessage, NamesTheOpArgumentRowAndValueOfEveryKind) {
  struct Case {
    DeviceFault fault;
    std::string expected;
  };
  const Case cases[] = {
      {fault_of(FaultKind::kBlockId, Op::kDecode, FaultArg::kBlockTable, 3, 6, 10000, 8),
       "decode: kv_cache.block_table: row 3, index 6 holds block 10000, read by the kernel; "
       "accepted block ids are 0 .. 7"},
      {fault_of(FaultKind::kBlockId, Op::kPrefill, FaultArg::kBlockTable, 0, 2, -1, 8),
       "prefill: kv_cache.block_table: row 0, index 2 holds block -1 (an invalid entry)"},
      {fault_of(FaultKind::kSeqLen, Op::kDecode, FaultArg::kSeqLens, 1, 0, 5000, 112),
       "decode: kv_cache.seq_lens: row 1 holds 5000 tokens; accepted 0 .. 112"},
      {fault_of(FaultKind::kPosition, Op::kAppendKv, FaultArg::kPositions, 0, 5, 9005, 64),
       "append_kv: positions: token 5 (block-table row 0) at position 9005 needs a slot outside "
       "its row of 64 slots"},
      {fault_of(FaultKind::kCuSeqlensOrder, Op::kPrefill, FaultArg::kCuSeqlensQ, 2, 3, 7, 9),
       "prefill: cu_seqlens_q: entry 3 = 7 is below entry 2 = 9"},
      {fault_of(FaultKind::kCuSeqlensRange, Op::kForward, FaultArg::kCuSeqlensKv, 0, 1, 900, 512),
       "forward: cu_seqlens_kv: entry 1 = 900 is outside 0 .. 512"},
      {fault_of(FaultKind::kIndirection, Op::kDecode, FaultArg::kCacheIndirection, 5, 17, 4, 2),
       "decode: cache_indirection: row 5, position 17 names beam 4; accepted beams 0 .. 1"},
      {fault_of(FaultKind::kRowIndex, Op::kAppendKv, FaultArg::kRowOfToken, 0, 2, 40, 4),
       "append_kv: row_of_token: token 2 names block-table row 40; accepted rows 0 .. 3"},
  };
  for (const Case& c : cases) {
    const std::string message = describe_device_fault(c.fault, Device::cuda(1));
    EXPECT_NE(message.find(c.expected), std::string::npos) << message;
    EXPECT_NE(message.find("device fault on cuda:1; 1 fault recorded since the last check"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("faulting rows are written as zeros"), std::string::npos) << message;
  }
}

TEST(DeviceFaultMessage, CountsFaultsAndSurvivesWordsNoKernelWrites) {
  const DeviceFault many =
      fault_of(FaultKind::kSeqLen, Op::kForward, FaultArg::kSeqLens, 7, 0, -3, 64, 12);
  EXPECT_NE(describe_device_fault(many, Device::cuda(0)).find("12 faults recorded"),
            std::string::npos);
  // The word comes from device memory: unknown kinds, ops and arguments are printed, not trusted.
  DeviceFault garbage = fault_of(static_cast<FaultKind>(99), static_cast<Op>(77),
                                 static_cast<FaultArg>(-5), 1, 2, 3, 4);
  const std::string message = describe_device_fault(garbage, Device::cuda(0));
  EXPECT_NE(message.find("(unknown op): (unknown argument): fault kind 99"), std::string::npos)
      << message;
}

TEST(DeviceFaultError, IsAnErrorThatCarriesTheWord) {
  const DeviceFault f =
      fault_of(FaultKind::kBlockId, Op::kDecode, FaultArg::kBlockTable, 3, 6, 10000, 8);
  try {
    throw DeviceFaultError(f, Device::cuda(0));
  } catch (const Error& e) {
    const auto* fault_error = dynamic_cast<const DeviceFaultError*>(&e);
    ASSERT_NE(fault_error, nullptr);
    EXPECT_EQ(fault_error->fault().value, 10000);
    EXPECT_EQ(fault_error->fault().row, 3);
    EXPECT_EQ(fault_error->device(), Device::cuda(0));
    EXPECT_EQ(std::string(e.what()), describe_device_fault(f, Device::cuda(0)));
  }
}

TEST(CheckDeviceErrors, SucceedsWithoutAGpuOrWithoutCudaWork) {
  // Nothing has run on a CUDA device in this process: no CUDA call, no error (also in a build
  // without CUDA).
  if (!cuda_devices().empty()) GTEST_SKIP() << "a CUDA device is visible (tests/gpu cover it)";
  EXPECT_NO_THROW(check_device_errors());
  EXPECT_NO_THROW(check_device_errors(nullptr));
}

TEST(CheckedMode, EnvironmentRuleAcceptsTheDocumentedSpellings) {
  for (const char* on : {"1", "true", "TRUE", "on", "Yes"}) {
    EXPECT_TRUE(detail::parse_checked_mode(on)) << on;
  }
  for (const char* off : {"", "0", "false", "Off", "no"}) {
    EXPECT_FALSE(detail::parse_checked_mode(off)) << off;
  }
  EXPECT_FALSE(detail::parse_checked_mode(nullptr));
  try {
    detail::parse_checked_mode("2");
    ADD_FAILURE() << "ATTNKIT_CHECKED=2 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ATTNKIT_CHECKED: accepted 1, true, on, yes"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("got '2'"), std::string::npos) << e.what();
  }
}

TEST(CheckedMode, CpuCallsRunAsUsual) {
  // CPU calls are synchronous and validated on the host: checked mode changes nothing for them.
  const AttentionSpec spec = small_spec();
  CacheFixture cache({5, 9});
  auto q = make_input(DType::kF32, {2, 4, 16});
  auto out = make_output(DType::kF32, {2, 4, 16});
  auto out_checked = make_output(DType::kF32, {2, 4, 16});
  DecodeArgs args;
  args.q = *q;
  args.kv_cache = cache.view;
  args.out = *out;
  decode(spec, args);
  args.out = *out_checked;
  args.checked = true;
  decode(spec, args);
  EXPECT_EQ(out->bytes(), out_checked->bytes());
}

}  // namespace
}  // namespace attnkit::test
