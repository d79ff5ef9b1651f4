// The FP8 kernel's index maps (src/cuda/prefill/prefill_sm90_fp8_layout.h), checked on the host by
// replaying the kernel's V transpose over a random tile and its P V over a random P: the same
// functions the device code calls, so a wrong map fails here before any GPU runs it.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "cuda/prefill/prefill_sm90_fp8_layout.h"
#include "cuda/sage/sage_quant_params.h"

namespace attnkit::test {
namespace {

namespace L = cuda::prefill::fp8_layout;

// Replays transpose_v_tile: 4 warps x 32 lanes, the steps (n, m) and the 4 x 4 byte blocks.
// Returns V^T bytes and counts how often each was written.
struct Transposed {
  std::vector<uint8_t> vt;
  std::vector<int> writes;
};

Transposed transpose(const std::vector<uint8_t>& staged, int head_dim, int valid) {
  const int col_block_bytes = L::kVtKeys * 128;
  Transposed t;
  t.vt.assign(static_cast<size_t>(head_dim) * 128, 0);
  t.writes.assign(t.vt.size(), 0);
  for (int warp = 0; warp < 4; ++warp) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int n = warp; n < head_dim / 32; n += 4) {
        const int d0 = L::transpose_d0(lane, n);
        for (int m = 0; m < 8; ++m) {
          const int q = L::transpose_quad(lane, m);
          for (int j = 0; j < 4; ++j) {
            const int key = L::quad_key(q, j);
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte =
                  key < valid ? staged[L::staged_offset(key, d0, col_block_bytes) + i] : 0;
              const uint32_t at = L::vt_offset(d0 + i, 4 * q) + j;
              t.vt[at] = byte;
              ++t.writes[at];
            }
          }
        }
      }
    }
  }
  return t;
}

TEST(PrefillFp8Layout, TransposeWritesEveryByteOnceWithPermutedKeys) {
  std::mt19937_64 rng(7);
  for (int head_dim : {128, 256}) {
    for (int valid : {128, 77, 1}) {
      // V [128 keys x head_dim] and its staged (swizzled, column-blocked) bytes.
      std::vector<uint8_t> v(static_cast<size_t>(L::kVtKeys) * head_dim);
      for (uint8_t& x : v) x = static_cast<uint8_t>(rng());
      std::vector<uint8_t> staged(v.size());
      for (int key = 0; key < L::kVtKeys; ++key) {
        for (int d0 = 0; d0 < head_dim; d0 += 4) {
          for (int i = 0; i < 4; ++i) {
            staged[L::staged_offset(key, d0, L::kVtKeys * 128) + i] = v[key * head_dim + d0 + i];
          }
        }
      }
      const Transposed t = transpose(staged, head_dim, valid);
      for (int w : t.writes) ASSERT_EQ(w, 1) << "a V^T byte written " << w << " times";
      for (int d = 0; d < head_dim; ++d) {
        for (int k = 0; k < L::kVtKeys; ++k) {
          const int key = L::vt_key(k);
          const uint8_t want = key < valid ? v[key * head_dim + d] : 0;
          ASSERT_EQ(t.vt[L::vt_offset(d, k & ~3) + (k & 3)], want)
              << "head_dim " << head_dim << " valid " << valid << " d " << d << " k " << k;
        }
      }
    }
  }
}

TEST(PrefillFp8Layout, VtKeyIsAPermutationOfEachStep) {
  for (int step = 0; step < L::kVtKeys; step += 32) {
    std::set<int> keys;
    for (int k = step; k < step + 32; ++k) {
      const int key = L::vt_key(k);
      EXPECT_GE(key, step);
      EXPECT_LT(key, step + 32);
      keys.insert(key);
    }
    EXPECT_EQ(keys.size(), 32u);
  }
  for (int q = 0; q < 32; ++q) {
    for (int j = 0; j < 4; ++j) EXPECT_EQ(L::quad_key(q, j), L::vt_key(4 * q + j));
  }
}

// The SAGE pass and the fp8 transposes write V^T in the column order the kernel's V^T ring holds:
// column vt_column_of_key(k) of a step holds key k, so a TMA box of 128 columns is the ring tile.
TEST(PrefillFp8Layout, VtColumnOfKeyInvertsVtKey) {
  for (int k = 0; k < L::kVtKeys; ++k) {
    EXPECT_EQ(L::vt_key(L::vt_column_of_key(k)), k);
    EXPECT_EQ(L::vt_column_of_key(L::vt_key(k)), k);
  }
}

// Sequences of random lengths map their tokens to distinct V^T columns inside the row stride, a
// tile's keys at the tile's own 128 columns (the kernel's box starts at the sequence's column plus
// the tile's first key).
TEST(PrefillFp8Layout, VtColumnsOfSequencesNeverCollide) {
  namespace S = cuda::sage;
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 20; ++trial) {
    const int seqs = 1 + static_cast<int>(rng() % 6);
    std::vector<int64_t> start(seqs + 1, 0);
    for (int b = 0; b < seqs; ++b) start[b + 1] = start[b] + static_cast<int64_t>(rng() % 300);
    const int64_t stride = S::vt_row_stride(start[seqs], seqs);
    std::vector<int> owner(static_cast<size_t>(stride), -1);
    for (int b = 0; b < seqs; ++b) {
      for (int64_t t = 0; t < start[b + 1] - start[b]; ++t) {
        const int64_t col = S::vt_column(start[b], b, t);
        ASSERT_LT(col, stride);
        EXPECT_EQ(owner[col], -1) << "two tokens in column " << col;
        owner[col] = b;
        const int64_t tile0 = S::vt_seq_column(start[b], b) + t / 128 * 128;
        EXPECT_EQ(S::vt_column(start[b], b, t) - tile0,
                  L::vt_column_of_key(static_cast<int>(t % 128)));
      }
    }
  }
}

// Each warp-wide load and store of the transpose touches 32 different banks.
TEST(PrefillFp8Layout, TransposeIsBankConflictFree) {
  for (int head_dim : {128, 256}) {
    for (int n = 0; n < head_dim / 32; ++n) {
      for (int m = 0; m < 8; ++m) {
        for (int j = 0; j < 4; ++j) {
          std::set<uint32_t> load_banks, store_banks;
          for (int lane = 0; lane < 32; ++lane) {
            const int d0 = L::transpose_d0(lane, n), q = L::transpose_quad(lane, m);
            load_banks.insert(L::staged_offset(L::quad_key(q, j), d0, L::kVtKeys * 128) / 4 % 32);
            store_banks.insert(L::vt_offset(d0 + j, 4 * q) / 4 % 32);
          }
          EXPECT_EQ(load_banks.size(), 32u) << "n " << n << " m " << m << " j " << j;
          EXPECT_EQ(store_banks.size(), 32u) << "n " << n << " m " << m << " j " << j;
        }
      }
    }
  }
}

// P V with the P registers as the consumer builds them (p_source) and V^T as the transpose lays
// it out equals sum over keys of P[row][key] V[key][d], for every thread of a warp.
TEST(PrefillFp8Layout, PRegistersPairEachProbabilityWithItsKey) {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int> small(-8, 8);
  const int keys = 32;                     // one k32 step
  std::vector<int> p(16 * keys), v(keys);  // P [16 rows x 32 keys] of one warp; one V column
  for (int& x : p) x = small(rng);
  for (int& x : v) x = small(rng);
  // The accumulator: thread (g, t) element 4 i + 2 rr + e is row g + 8 rr, key 8 i + 2 t + e.
  auto acc = [&](int lane, int e) {
    const int g = lane / 4, t = lane % 4;
    const int i = e / 4, rr = (e / 2) % 2, c = e % 2;
    return p[(g + 8 * rr) * keys + 8 * i + 2 * t + c];
  };
  for (int row = 0; row < 16; ++row) {
    long want = 0;
    for (int key = 0; key < keys; ++key) want += static_cast<long>(p[row * keys + key]) * v[key];
    // The MMA: row r of A times column of B over k; A's (row, k) comes from the thread and byte
    // that hold it in the 8-bit A layout, B's k is V^T column k = V[vt_key(k)].
    long got = 0;
    for (int k = 0; k < keys; ++k) {
      const int half = k / 16, t = (k % 16) / 4, j = k % 4;
      const int g = row % 8, r = 2 * half + row / 8;
      got += static_cast<long>(acc(4 * g + t, L::p_source(r, j))) * v[L::vt_key(k)];
    }
    EXPECT_EQ(got, want) << "row " << row;
  }
}

}  // namespace
}  // namespace attnkit::test
