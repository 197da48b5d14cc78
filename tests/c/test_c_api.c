/* The C ABI used from C (C99): the header compiles as C, options default correctly, a forward call
   runs on the CPU reference and on the default CPU backend, and errors come back with a message. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashattn/flashattn.h"

static int failures = 0;
#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);      \
      fprintf(stderr, __VA_ARGS__);                             \
      fprintf(stderr, "\n");                                    \
      ++failures;                                               \
    }                                                           \
  } while (0)

int main(void) {
  enum { B = 1, S = 33, H = 2, D = 16 };
  const int64_t shape[4] = {B, S, H, D};
  const int64_t lse_shape[3] = {B, H, S};
  float *q = malloc(sizeof(float) * B * S * H * D), *k = malloc(sizeof(float) * B * S * H * D);
  float *v = malloc(sizeof(float) * B * S * H * D), *out = malloc(sizeof(float) * B * S * H * D);
  float *out_ref = malloc(sizeof(float) * B * S * H * D), *lse = malloc(sizeof(float) * B * H * S);
  unsigned seed = 12345u;
  for (int n = 0; n < B * S * H * D; ++n) {
    seed = seed * 1103515245u + 12345u;
    q[n] = (float)((seed >> 9) % 2001) / 1000.0f - 1.0f;
    seed = seed * 1103515245u + 12345u;
    k[n] = (float)((seed >> 9) % 2001) / 1000.0f - 1.0f;
    seed = seed * 1103515245u + 12345u;
    v[n] = (float)((seed >> 9) % 2001) / 1000.0f - 1.0f;
  }
  fa_options options;
  fa_options_init(&options);
  CHECK(options.window_left == -1 && options.window_right == -1, "fa_options_init windows");
  options.causal = 1;

  fa_forward_args args;
  memset(&args, 0, sizeof(args));
  args.q = fa_tensor_contiguous(q, 4, shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
  args.k = fa_tensor_contiguous(k, 4, shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
  args.v = fa_tensor_contiguous(v, 4, shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
  args.out = fa_tensor_contiguous(out_ref, 4, shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
  args.lse = fa_tensor_contiguous(lse, 3, lse_shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
  CHECK(args.q.strides[0] == S * H * D && args.q.strides[3] == 1, "contiguous strides");

  fa_error error;
  options.backend = FA_BACKEND_CPU_REFERENCE;
  CHECK(fa_forward(&args, &options, &error) == FA_OK, "reference forward: %s", error.message);

  /* the default backend (CPU flash) agrees with the reference */
  options.backend = FA_BACKEND_AUTO;
  args.out = fa_tensor_contiguous(out, 4, shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
  for (int n = 0; n < B * S * H * D; ++n) out[n] = NAN;
  fa_status status = fa_forward(&args, &options, &error);
  CHECK(status == FA_OK, "default forward: %s", error.message);
  double diff = 0, norm = 0;
  for (int n = 0; n < B * S * H * D; ++n) {
    diff += (out[n] - out_ref[n]) * (double)(out[n] - out_ref[n]);
    norm += out_ref[n] * (double)out_ref[n];
  }
  CHECK(status != FA_OK || sqrt(diff / norm) < 1e-5, "flash vs reference rel error %g", sqrt(diff / norm));

  /* an error names the argument and the rule */
  args.k.shape[2] = 3;
  args.v.shape[2] = 3;
  status = fa_forward(&args, &options, &error);
  CHECK(status == FA_ERROR_INVALID_ARGUMENT, "expected invalid argument, got %s", fa_status_name(status));
  CHECK(strstr(error.message, "k: dimension 2 (Hk) must divide") != NULL, "message: %s", error.message);
  CHECK(strcmp(fa_status_name(FA_ERROR_NOT_COMPILED), "NOT_COMPILED") == 0, "status name");
  CHECK(fa_version()[0] != '\0' && fa_build_info()[0] != '\0', "version / build info");

  /* the struct layout: options of another FA_ABI_VERSION are refused before any other struct is read (args is not
     looked at: NULL here), and fa_options_init_abi of another version writes only abi_version */
  CHECK(fa_abi_version() == FA_ABI_VERSION, "fa_abi_version %d, header %d", fa_abi_version(), FA_ABI_VERSION);
  CHECK(options.abi_version == FA_ABI_VERSION, "fa_options_init records FA_ABI_VERSION");
  fa_options foreign;
  memset(&foreign, 0xAB, sizeof(foreign));
  fa_options_init_abi(&foreign, FA_ABI_VERSION + 1);
  const unsigned char* bytes = (const unsigned char*)&foreign;
  int untouched = 1;
  for (size_t n = sizeof(foreign.abi_version); n < sizeof(foreign); ++n) untouched = untouched && bytes[n] == 0xAB;
  CHECK(foreign.abi_version == FA_ABI_VERSION + 1 && untouched, "fa_options_init_abi of another version: abi_version only");
  fa_kvcache_plan plan;
  status = fa_plan_kvcache(NULL, &foreign, &plan, &error);
  CHECK(status == FA_ERROR_INVALID_ARGUMENT && strstr(error.message, "options.abi_version: the caller was built with") != NULL,
        "foreign options: %s %s", fa_status_name(status), error.message);
  status = fa_forward(&args, &foreign, &error);
  CHECK(status == FA_ERROR_INVALID_ARGUMENT && strstr(error.message, "options.abi_version") != NULL, "forward, foreign options: %s",
        error.message);
  fa_options zeroed;
  memset(&zeroed, 0, sizeof(zeroed));
  status = fa_kvcache(NULL, &zeroed, &error);
  CHECK(status == FA_ERROR_INVALID_ARGUMENT && strstr(error.message, "fill options with fa_options_init()") != NULL,
        "zeroed options: %s", error.message);

  /* fa_kvcache_append from C: two sequences of a contiguous float32 cache (B = 2, S_cache = 4, Hk = 1, D = 2) take 2
     and 1 new rows at rows 1.. and 3; every other element keeps its value. */
  {
    float k_cache[2 * 4 * 2], v_cache[2 * 4 * 2], k_new[3 * 2], v_new[3 * 2];
    int32_t seqlens[2] = {1, 3}, cu[3] = {0, 2, 3};
    for (int n = 0; n < 16; ++n) k_cache[n] = v_cache[n] = -1.f;
    for (int n = 0; n < 6; ++n) k_new[n] = (float)n, v_new[n] = 10.f + (float)n;
    const int64_t cache_shape[4] = {2, 4, 1, 2}, rows_shape[3] = {3, 1, 2}, b_shape[1] = {2}, cu_shape[1] = {3};
    fa_kvcache_append_args append;
    memset(&append, 0, sizeof(append));
    append.k_cache = fa_tensor_contiguous(k_cache, 4, cache_shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
    append.v_cache = fa_tensor_contiguous(v_cache, 4, cache_shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
    append.k_new = fa_tensor_contiguous(k_new, 3, rows_shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
    append.v_new = fa_tensor_contiguous(v_new, 3, rows_shape, FA_FLOAT32, FA_DEVICE_CPU, 0);
    append.cache_seqlens = fa_tensor_contiguous(seqlens, 1, b_shape, FA_INT32, FA_DEVICE_CPU, 0);
    append.cu_seqlens_new = fa_tensor_contiguous(cu, 1, cu_shape, FA_INT32, FA_DEVICE_CPU, 0);
    append.max_seqlen_new = 2;
    status = fa_kvcache_append(&append, &options, &error);
    CHECK(status == FA_OK, "fa_kvcache_append: %s", error.message);
    /* sequence 0: rows 1, 2 <- new rows 0, 1; sequence 1: row 3 <- new row 2 (element offsets 8 + 6 = 14) */
    const int written[3] = {2, 4, 14};
    for (int r = 0; r < 3; ++r)
      for (int c = 0; c < 2; ++c) {
        CHECK(k_cache[written[r] + c] == k_new[2 * r + c], "k_cache element %d", written[r] + c);
        CHECK(v_cache[written[r] + c] == v_new[2 * r + c], "v_cache element %d", written[r] + c);
      }
    int others = 0;
    for (int n = 0; n < 16; ++n) others += (n < 2 || (n >= 6 && n < 14)) && k_cache[n] != -1.f;
    CHECK(others == 0, "fa_kvcache_append wrote %d elements outside the new rows", others);
    append.max_seqlen_new = 1;
    status = fa_kvcache_append(&append, &options, &error);
    CHECK(status == FA_ERROR_INVALID_ARGUMENT && strstr(error.message, "cu_seqlens_new: sequence 0 has length 2 > max_seqlen_new = 1"),
          "fa_kvcache_append over max_seqlen_new: %s", error.message);
  }

  free(q), free(k), free(v), free(out), free(out_ref), free(lse);
  if (failures == 0) printf("test_c_api: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
