#include "kvcache_cases.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/dtype.hpp"

namespace fa_test {

std::string KvCase::to_string() const {
  std::string s = std::string(flashattn::dtype_name(dtype)) + " B=" + std::to_string(batch) + " Sq=" +
                  std::to_string(seqlen_q) + " Hq=" + std::to_string(heads_q) + " Hk=" + std::to_string(heads_k) +
                  " D=" + std::to_string(head_dim) + " new=" + std::to_string(seqlen_new) + " cap=" + std::to_string(capacity) +
                  " block=" + std::to_string(block_size) + (repeat_blocks ? " repeated" : "") +
                  (heads_major_blocks ? " heads-major" : "") + (cache_row_pad ? " row-pad=" + std::to_string(cache_row_pad) : "") +
                  " rotary=" + std::to_string(rotary) + "/" + std::to_string(rotary_dim) + " causal=" + std::to_string(causal) +
                  " window=(" + std::to_string(window_left) + "," + std::to_string(window_right) + ") softcap=" +
                  std::to_string(softcap) + " alibi=" + std::to_string(alibi) + (dropout_p > 0 ? " dropout=" + std::to_string(dropout_p) : "") +
                  " splits=" + std::to_string(num_splits) + " std=" + std::to_string(input_std) + " cached=[";
  for (int c : cached) s += std::to_string(c) + ",";
  if (!leftpad.empty()) {
    s += "] leftpad=[";
    for (int c : leftpad) s += std::to_string(c) + ",";
  }
  if (fp8) s += " fp8 k_scale=" + std::to_string(k_scale) + " v_scale=" + std::to_string(v_scale);
  return s + "]";
}

fa_kvcache_args KvTensors::args() {
  fa_kvcache_args a{};
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.q = q.view();
  a.k_cache = k_cache.view();
  a.v_cache = v_cache.view();
  if (present(block_table)) a.block_table = block_table.view();
  if (present(cache_batch_idx)) a.cache_batch_idx = cache_batch_idx.view();
  if (present(cache_leftpad)) a.cache_leftpad = cache_leftpad.view();
  a.cache_seqlens = cache_seqlens.view();
  if (present(k_new)) {
    a.k_new = k_new.view();
    a.v_new = v_new.view();
  }
  if (present(cos)) {
    a.rotary_cos = cos.view();
    a.rotary_sin = sin.view();
    a.rotary_interleaved = rotary_interleaved;
  }
  a.out = out.view();
  a.lse = lse.view();
  return a;
}

KvTensors make_kv(const KvCase& c, std::mt19937_64& rng) {
  KvTensors t;
  const int d = c.head_dim;
  const fa_dtype cache_dtype = c.fp8 ? FA_FLOAT8_E4M3 : c.dtype;
  if (c.fp8) {
    t.k_scale = c.k_scale;
    t.v_scale = c.v_scale;
  }
  t.q = HostTensor({c.batch, c.seqlen_q, c.heads_q, d}, c.dtype);
  t.q.fill_normal(rng, c.input_std);
  if (c.block_size == 0) {
    const int64_t row = int64_t(c.heads_k) * d + c.cache_row_pad;
    const std::vector<int64_t> strides = {c.capacity * row, row, d, 1};
    t.k_cache = HostTensor({c.batch, c.capacity, c.heads_k, d}, strides, cache_dtype);
    t.v_cache = HostTensor({c.batch, c.capacity, c.heads_k, d}, strides, cache_dtype);
  } else {
    const int per_seq = (c.capacity + c.block_size - 1) / c.block_size;
    const int blocks = c.batch * per_seq + 3;  // 3 spare blocks no sequence owns
    const std::vector<int64_t> strides =
        c.heads_major_blocks ? std::vector<int64_t>{int64_t(c.heads_k) * c.block_size * d, d, int64_t(c.block_size) * d, 1}
                             : std::vector<int64_t>{int64_t(c.block_size) * c.heads_k * d, int64_t(c.heads_k) * d, d, 1};
    t.k_cache = HostTensor({blocks, c.block_size, c.heads_k, d}, strides, cache_dtype);
    t.v_cache = HostTensor({blocks, c.block_size, c.heads_k, d}, strides, cache_dtype);
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    for (int n = 0; n < blocks; ++n) ids[size_t(n)] = n;
    std::shuffle(ids.begin(), ids.end(), rng);
    t.block_table = HostTensor({c.batch, per_seq}, FA_INT32);
    for (int n = 0; n < c.batch * per_seq; ++n)
      t.block_table.set_int(n, c.repeat_blocks ? int32_t(rng() % uint64_t(blocks)) : ids[size_t(n)]);
  }
  // FP8: codes of standard deviation std / scale, so the real (dequantised) values have about std
  t.k_cache.fill_normal(rng, c.input_std / (c.fp8 ? c.k_scale : 1.0));
  t.v_cache.fill_normal(rng, 1.0 / (c.fp8 ? c.v_scale : 1.0));
  t.cache_seqlens = HostTensor({c.batch}, FA_INT32);
  for (int b = 0; b < c.batch; ++b) t.cache_seqlens.set_int(b, c.cached[size_t(b)]);
  if (!c.leftpad.empty()) {
    t.cache_leftpad = HostTensor({c.batch}, FA_INT32);
    for (int b = 0; b < c.batch; ++b) t.cache_leftpad.set_int(b, c.leftpad[size_t(b)]);
  }
  if (c.seqlen_new > 0) {
    t.k_new = HostTensor({c.batch, c.seqlen_new, c.heads_k, d}, c.dtype);
    t.v_new = HostTensor({c.batch, c.seqlen_new, c.heads_k, d}, c.dtype);
    t.k_new.fill_normal(rng, c.input_std);
    t.v_new.fill_normal(rng);
  }
  if (c.rotary != 0) {
    t.rotary_interleaved = c.rotary == 2;
    const int rd = c.rotary_dim > 0 ? c.rotary_dim : d;
    // every position a length the call allows reaches (CUDA's rule, its lengths being in device memory): the
    // table's capacity (whole blocks) + Sq
    const int table_rows = c.block_size > 0 ? (c.capacity + c.block_size - 1) / c.block_size * c.block_size : c.capacity;
    const int positions = table_rows + c.seqlen_q;
    t.cos = HostTensor({positions, rd / 2}, c.dtype);
    t.sin = HostTensor({positions, rd / 2}, c.dtype);
    for (int pos = 0; pos < positions; ++pos)
      for (int f = 0; f < rd / 2; ++f) {
        const double angle = pos * std::pow(10000.0, -2.0 * f / rd);
        t.cos.set(int64_t(pos) * (rd / 2) + f, std::cos(angle));
        t.sin.set(int64_t(pos) * (rd / 2) + f, std::sin(angle));
      }
  }
  if (c.alibi) {
    t.slopes = HostTensor({c.heads_q}, FA_FLOAT32);
    t.slopes.fill_uniform(rng, 0.05, 0.5);
  }
  t.out = HostTensor({c.batch, c.seqlen_q, c.heads_q, d}, c.dtype);
  t.lse = HostTensor({c.batch, c.heads_q, c.seqlen_q}, FA_FLOAT32);
  t.out.poison();
  t.lse.poison();
  for (int b = 0; b < int(c.leftpad.size()); ++b) {
    poison_cache_rows(c, t, b, 0, c.leftpad[size_t(b)]);
    // A block wholly inside the padding is never addressed: its table entry may be any value (here no block id).
    if (c.block_size > 0)
      for (int n = 0; (n + 1) * c.block_size <= c.leftpad[size_t(b)]; ++n)
        t.block_table.set_int(int64_t(b) * t.block_table.shape()[1] + n, n % 2 ? -1 : std::numeric_limits<int32_t>::max() / 2);
  }
  return t;
}

int64_t cache_index(const KvCase& c, const KvTensors& t, int b, int j, int hk, int x) {
  int64_t block = b, row = j;
  if (c.block_size > 0) {
    block = t.block_table.get_int(int64_t(b) * t.block_table.shape()[1] + j / c.block_size);
    row = j % c.block_size;
  }
  const int64_t rows = c.block_size > 0 ? c.block_size : c.capacity;
  return ((block * rows + row) * c.heads_k + hk) * c.head_dim + x;
}

void poison_cache_rows(const KvCase& c, KvTensors& t, int b, int j_begin, int j_end) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Rows in parallel, each its own places; repeated blocks (repeat_blocks) share places across sequences' rows, so those
  // tables take one chunk (one thread).
  const int64_t rows = std::max(0, j_end - j_begin);
  parallel_chunks(rows, c.repeat_blocks ? std::max<int64_t>(rows, 1) : 256, [&](int64_t begin, int64_t end) {
    for (int j = j_begin + int(begin); j < j_begin + int(end); ++j)
      for (int hk = 0; hk < c.heads_k; ++hk)
        for (int x = 0; x < c.head_dim; ++x) {
          t.k_cache.set(cache_index(c, t, b, j, hk, x), nan);
          t.v_cache.set(cache_index(c, t, b, j, hk, x), nan);
        }
  });
}

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.storage_bytes() == b.storage_bytes() && std::memcmp(a.data(), b.data(), size_t(a.storage_bytes())) == 0;
}

}  // namespace fa_test
