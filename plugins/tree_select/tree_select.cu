// CUDA build of the tree selection: one thread block per request running the
// __host__ __device__ logic of tree_select.h with lane = threadIdx.x, plus the C
// ABI launcher of tree_select_api.h. Compile: nvcc -arch=sm_90 (or sm_80) -c.
#include <cuda_runtime.h>

#include "tree_select.h"
#include "tree_select_api.h"

// Device team: lanes are the block's threads, phases end at a block barrier.
struct MoespecBlockTeam {
  template <class F>
  __device__ void for_each(F f) const {
    f(static_cast<int64_t>(threadIdx.x), static_cast<int64_t>(blockDim.x));
    __syncthreads();
  }
  template <class F>
  __device__ void single(F f) const {
    if (threadIdx.x == 0) f();
    __syncthreads();
  }
};

// Launch bounds: without them ptxas gives the kernel 78 registers, and blocks above ~800 threads fail to
// launch (cudaErrorLaunchOutOfResources) although the API accepts up to 1024.
__global__ void __launch_bounds__(1024) moespec_tree_select_kernel(MoespecParams p, const float* scores, const int64_t* parents,
                                           const uint8_t* valid, const int64_t* depth, const int64_t* node_bits,
                                           const int64_t* root_bits, const double* cost_table, int64_t* out_idx,
                                           int64_t* out_count, double* out_expected, double* out_cost,
                                           int64_t* workspace) {
  const int64_t b = blockIdx.x, n = p.num_nodes, w = p.num_words;
  MoespecRequest r;
  r.scores = scores + b * n;
  r.parents = parents + b * n;
  r.valid = valid + b * n;
  r.depth = depth + b * n;
  r.node_bits = node_bits + b * n * w;
  r.root_bits = root_bits + b * w;
  r.cost_table = cost_table;
  r.out_idx = out_idx + b * p.budget;
  r.out_count = out_count + b;
  r.out_expected = out_expected + b;
  r.out_cost = out_cost + b;
  r.ws = workspace + b * moespec_workspace_words(n, w);
  moespec_select_request(MoespecBlockTeam{}, r, p);
}

extern "C" size_t moespec_tree_select_workspace_bytes(int64_t batch, int64_t num_nodes, int64_t num_words) {
  return static_cast<size_t>(batch * moespec_workspace_words(num_nodes, num_words)) * sizeof(int64_t);
}

extern "C" int32_t moespec_tree_select_cuda(int64_t batch, int64_t num_nodes, int64_t num_words, const float* scores,
                                            const int64_t* parents, const uint8_t* valid, const int64_t* depth,
                                            const int64_t* node_bits, const int64_t* root_bits,
                                            const double* cost_table, int64_t cost_len, int32_t mode, int64_t budget,
                                            double c0, double c_tok, double c_exp, double eps, int64_t* out_idx,
                                            int64_t* out_count, double* out_expected, double* out_cost,
                                            void* workspace, int32_t threads, void* stream) {
  MoespecParams p;
  const int32_t status = moespec_make_params(mode, num_nodes, num_words, budget, cost_len, c0, c_tok, c_exp, eps, &p);
  if (status != MOESPEC_OK) return status;
  if (batch < 0 || threads < 1 || threads > 1024) return MOESPEC_BAD_SHAPE;
  if (batch == 0) return MOESPEC_OK;
  moespec_tree_select_kernel<<<static_cast<unsigned>(batch), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      p, scores, parents, valid, depth, node_bits, root_bits, cost_table, out_idx, out_count, out_expected, out_cost,
      static_cast<int64_t*>(workspace));
  return cudaGetLastError() == cudaSuccess ? MOESPEC_OK : MOESPEC_CUDA_ERROR;
}
