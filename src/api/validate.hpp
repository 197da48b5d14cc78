// Validation: public fa_* structs -> params structs, checking every rule before any memory is
// touched. Each rule's message starts with the argument it concerns and states the rule:
//   "k: dimension 2 (Hk) must divide q's Hq = 12, got 5"
// Backend-specific support (compiled head dims, features) is checked by the backend's own
// `supports` function, called by dispatch right after this.
#pragma once

#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::api {

Status make_forward_params(const fa_forward_args& args, const fa_options& options,
                           AttentionParams* params);
Status make_backward_params(const fa_backward_args& args, const fa_options& options,
                            BackwardParams* params);
Status make_kvcache_params(const fa_kvcache_args& args, const fa_options& options,
                           KvcacheParams* params);
Status make_kvcache_append_params(const fa_kvcache_append_args& args, const fa_options& options,
                                  KvcacheAppendParams* params);

// The backend that will run: options.backend, or the tensors' device when it is AUTO.
// Fails when the explicit choice cannot read tensors on that device.
Status resolve_backend(const fa_options& options, fa_device_kind device, int device_id,
                       fa_backend* backend);

const char* backend_name(fa_backend backend);

}  // namespace flashattn::api
