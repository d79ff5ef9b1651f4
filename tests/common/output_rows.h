// One call's outputs row by row, as the calls with bad metadata are checked (docs/safety.md): a
// faulting row is zeros with LSE -inf, every other row equals the same call with good metadata
// bit for bit. Host memory only (the bytes a test downloaded).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace attnkit::test {

// `rows` rows of out, `row_bytes` bytes each, and of the LSE, `heads` floats each (lse nullptr:
// the call has no LSE).
struct OutputRows {
  const uint8_t* out = nullptr;
  size_t row_bytes = 0;
  const float* lse = nullptr;
  int64_t heads = 0;
  int64_t rows = 0;

  const uint8_t* out_row(int64_t r) const { return out + static_cast<size_t>(r) * row_bytes; }
  const float* lse_row(int64_t r) const { return lse + r * heads; }
};

// Row r is a faulting row's: every byte of out zero (+0.0 in every element), every LSE -inf.
inline ::testing::AssertionResult is_zeroed_row(const OutputRows& got, int64_t r) {
  const uint8_t* row = got.out_row(r);
  size_t nonzero = 0;
  for (size_t i = 0; i < got.row_bytes; ++i) nonzero += row[i] != 0;
  if (nonzero != 0) {
    return ::testing::AssertionFailure()
           << "row " << r << ": " << nonzero << " bytes of out are not +0.0";
  }
  for (int64_t h = 0; got.lse != nullptr && h < got.heads; ++h) {
    const float lse = got.lse_row(r)[h];
    if (!(std::isinf(lse) && lse < 0)) {
      return ::testing::AssertionFailure()
             << "row " << r << ", head " << h << ": lse " << lse << ", not -inf";
    }
  }
  return ::testing::AssertionSuccess();
}

// Row r of `got` holds the bytes of row r_good of `good`, out and LSE.
inline ::testing::AssertionResult same_row(const OutputRows& got, int64_t r, const OutputRows& good,
                                           int64_t r_good) {
  if (std::memcmp(got.out_row(r), good.out_row(r_good), got.row_bytes) != 0) {
    return ::testing::AssertionFailure()
           << "row " << r << ": out differs from the call with good metadata";
  }
  if (got.lse != nullptr &&
      std::memcmp(got.lse_row(r), good.lse_row(r_good), sizeof(float) * got.heads) != 0) {
    return ::testing::AssertionFailure()
           << "row " << r << ": lse differs from the call with good metadata";
  }
  return ::testing::AssertionSuccess();
}

// Every row of `got`: the rows where faulting(r) zeroed, the others equal to good's bit for bit.
template <typename Faulting>
void expect_rows_zeroed_where(const OutputRows& got, const OutputRows& good, Faulting faulting) {
  for (int64_t r = 0; r < got.rows; ++r) {
    if (faulting(r)) {
      EXPECT_TRUE(is_zeroed_row(got, r)) << "(a faulting row)";
    } else {
      EXPECT_TRUE(same_row(got, r, good, r));
    }
  }
}

}  // namespace attnkit::test
