// Host build of the tree selection logic in tree_select.h, behind the C ABI of
// tree_select_api.h. Compile: g++ -O2 -ffp-contract=off -shared -fPIC -std=c++17.
#include <vector>

#include "tree_select.h"
#include "tree_select_api.h"

namespace {

MoespecRequest request_at(int64_t b, int64_t n, int64_t w, int64_t budget, const float* scores,
                          const int64_t* parents, const uint8_t* valid, const int64_t* depth,
                          const int64_t* node_bits, const int64_t* root_bits, const double* cost_table,
                          int64_t* out_idx, int64_t* out_count, double* out_expected, double* out_cost,
                          int64_t* ws) {
  MoespecRequest r;
  r.scores = scores + b * n;
  r.parents = parents + b * n;
  r.valid = valid + b * n;
  r.depth = depth + b * n;
  r.node_bits = node_bits + b * n * w;
  r.root_bits = root_bits + b * w;
  r.cost_table = cost_table;
  r.out_idx = out_idx + b * budget;
  r.out_count = out_count + b;
  r.out_expected = out_expected + b;
  r.out_cost = out_cost + b;
  r.ws = ws;
  return r;
}

}  // namespace

extern "C" size_t moespec_tree_select_workspace_bytes(int64_t batch, int64_t num_nodes, int64_t num_words) {
  return static_cast<size_t>(batch * moespec_workspace_words(num_nodes, num_words)) * sizeof(int64_t);
}

extern "C" int32_t moespec_tree_select_host(int64_t batch, int64_t num_nodes, int64_t num_words, const float* scores,
                                            const int64_t* parents, const uint8_t* valid, const int64_t* depth,
                                            const int64_t* node_bits, const int64_t* root_bits,
                                            const double* cost_table, int64_t cost_len, int32_t mode, int64_t budget,
                                            double c0, double c_tok, double c_exp, double eps, int64_t num_lanes,
                                            int64_t* out_idx, int64_t* out_count, double* out_expected,
                                            double* out_cost) {
  MoespecParams p;
  const int32_t status = moespec_make_params(mode, num_nodes, num_words, budget, cost_len, c0, c_tok, c_exp, eps, &p);
  if (status != MOESPEC_OK) return status;
  if (batch < 0 || num_lanes < 1) return MOESPEC_BAD_SHAPE;
  std::vector<int64_t> ws(static_cast<size_t>(moespec_workspace_words(num_nodes, num_words)));
  const MoespecSerialTeam team{num_lanes};
  for (int64_t b = 0; b < batch; ++b) {
    const MoespecRequest r = request_at(b, num_nodes, num_words, budget, scores, parents, valid, depth, node_bits,
                                        root_bits, cost_table, out_idx, out_count, out_expected, out_cost, ws.data());
    moespec_select_request(team, r, p);
  }
  return MOESPEC_OK;
}
