// C ABI of tree_select_plugin_kernels.cu (device pointers, one CUDA stream).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

size_t moespec_trt_workspace_bytes(int64_t batch, int64_t num_nodes, int64_t num_words, int64_t cost_len);

// Returns 0 or a MoespecStatus code (../tree_select/tree_select.h).
int32_t moespec_trt_enqueue(int64_t batch, int64_t num_nodes, int64_t num_words, int64_t cost_len,
                            const float* scores, const int64_t* parents, const uint8_t* valid, const int64_t* depth,
                            const int64_t* node_bits, const int64_t* root_bits, const float* cost_table, int32_t mode,
                            int64_t budget, double c0, double c_tok, double c_exp, double eps, int64_t* out_idx,
                            int64_t* out_count, float* out_expected, float* out_cost, void* workspace,
                            void* stream_ptr);

#ifdef __cplusplus
}
#endif
