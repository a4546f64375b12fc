// Device side of the native MoESpecTreeSelect plugin, free of TensorRT headers so
// it compiles (and is compile-tested) anywhere nvcc is: converts the float32 cost
// table to float64, runs the selection kernels (../tree_select), and converts the
// float64 expected tokens / predicted cost to the plugin's float32 outputs.
#include <cuda_runtime.h>
#include <stdint.h>

#include "../tree_select/tree_select_api.h"
#include "tree_select_plugin_kernels.h"

namespace {

__global__ void float_to_double(const float* in, double* out, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = static_cast<double>(in[i]);
}

__global__ void double_to_float(const double* in, float* out, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = static_cast<float>(in[i]);
}

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + 255) / 256); }

}  // namespace

extern "C" size_t moespec_trt_workspace_bytes(int64_t batch, int64_t num_nodes, int64_t num_words, int64_t cost_len) {
  return align256(sizeof(double) * static_cast<size_t>(cost_len > 0 ? cost_len : 1)) +
         2 * align256(sizeof(double) * static_cast<size_t>(batch > 0 ? batch : 1)) +
         align256(moespec_tree_select_workspace_bytes(batch, num_nodes, num_words));
}

extern "C" int32_t moespec_trt_enqueue(int64_t batch, int64_t num_nodes, int64_t num_words, int64_t cost_len,
                                       const float* scores, const int64_t* parents, const uint8_t* valid,
                                       const int64_t* depth, const int64_t* node_bits, const int64_t* root_bits,
                                       const float* cost_table, int32_t mode, int64_t budget, double c0, double c_tok,
                                       double c_exp, double eps, int64_t* out_idx, int64_t* out_count,
                                       float* out_expected, float* out_cost, void* workspace, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  char* ws = static_cast<char*>(workspace);
  double* table = reinterpret_cast<double*>(ws);
  ws += align256(sizeof(double) * static_cast<size_t>(cost_len > 0 ? cost_len : 1));
  double* expected = reinterpret_cast<double*>(ws);
  ws += align256(sizeof(double) * static_cast<size_t>(batch > 0 ? batch : 1));
  double* cost = reinterpret_cast<double*>(ws);
  ws += align256(sizeof(double) * static_cast<size_t>(batch > 0 ? batch : 1));
  if (batch == 0) return 0;
  if (cost_len > 0) float_to_double<<<blocks_for(cost_len), 256, 0, stream>>>(cost_table, table, cost_len);
  const int32_t status = moespec_tree_select_cuda(batch, num_nodes, num_words, scores, parents, valid, depth,
                                                  node_bits, root_bits, table, cost_len, mode, budget, c0, c_tok,
                                                  c_exp, eps, out_idx, out_count, expected, cost, ws, 128, stream);
  if (status != 0) return status;
  double_to_float<<<blocks_for(batch), 256, 0, stream>>>(expected, out_expected, batch);
  double_to_float<<<blocks_for(batch), 256, 0, stream>>>(cost, out_cost, batch);
  return cudaGetLastError() == cudaSuccess ? 0 : 6;
}
