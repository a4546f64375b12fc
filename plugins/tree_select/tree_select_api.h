// C ABI of the tree selection (host build: tree_select_host.cpp; CUDA: tree_select.cu).
// All tensors are contiguous, batch-major: scores [B, N] float32, parents/depth [B, N]
// int64, valid [B, N] uint8, node_bits [B, N, W] int64 per-node sets, root_bits [B, W]
// int64, cost_table [cost_len] float64; outputs out_idx [B, budget] int64,
// out_count [B] int64, out_expected [B] float64, out_cost [B] float64.
// Returns MOESPEC_OK (0) or a MoespecStatus code; nothing is written on a bad call.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bytes of workspace the CUDA launcher needs for B requests.
size_t moespec_tree_select_workspace_bytes(int64_t batch, int64_t num_nodes, int64_t num_words);

// Host: runs each request with `num_lanes` simulated lanes (1 = plain serial).
int32_t moespec_tree_select_host(int64_t batch, int64_t num_nodes, int64_t num_words, const float* scores,
                                 const int64_t* parents, const uint8_t* valid, const int64_t* depth,
                                 const int64_t* node_bits, const int64_t* root_bits, const double* cost_table,
                                 int64_t cost_len, int32_t mode, int64_t budget, double c0, double c_tok,
                                 double c_exp, double eps, int64_t num_lanes, int64_t* out_idx, int64_t* out_count,
                                 double* out_expected, double* out_cost);

// CUDA: one block of `threads` per request on `stream` (a cudaStream_t); pointers are
// device pointers, workspace has moespec_tree_select_workspace_bytes bytes.
int32_t moespec_tree_select_cuda(int64_t batch, int64_t num_nodes, int64_t num_words, const float* scores,
                                 const int64_t* parents, const uint8_t* valid, const int64_t* depth,
                                 const int64_t* node_bits, const int64_t* root_bits, const double* cost_table,
                                 int64_t cost_len, int32_t mode, int64_t budget, double c0, double c_tok,
                                 double c_exp, double eps, int64_t* out_idx, int64_t* out_count,
                                 double* out_expected, double* out_cost, void* workspace, int32_t threads,
                                 void* stream);

#ifdef __cplusplus
}
#endif
