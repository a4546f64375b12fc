// MoE-aware tree selection, one request at a time: the same algorithms as
// trtllm_moespec/core/select.py (EVICT, EcoSpec, EcoSpec-global, joint), written
// once as __host__ __device__ code.
//
// The per-request driver `moespec_select_request` is a template over a "team":
//   MoespecSerialTeam  runs every lane of a phase one after the other (host builds;
//                      with lanes > 1 it simulates a thread block phase by phase)
//   MoespecBlockTeam   (tree_select.cu) lane = threadIdx.x, __syncthreads() between phases
// A phase only reads what earlier phases wrote, so both teams compute the same thing.
// Shared state lives in a per-request workspace (moespec_workspace_words int64).
//
// Numerics match the reference bit for bit: float64 keys score / (token_cost +
// expert_cost * new) with explicitly rounded multiply/add (no FMA contraction),
// ties to the lowest node index, sums accumulated in the reference's order.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define MOESPEC_HD __host__ __device__
#else
#define MOESPEC_HD
#endif

enum MoespecMode : int32_t {
  MOESPEC_EVICT = 0,
  MOESPEC_ECOSPEC = 1,
  MOESPEC_ECOSPEC_GLOBAL = 2,
  MOESPEC_JOINT = 3,
};

enum MoespecStatus : int32_t {
  MOESPEC_OK = 0,
  MOESPEC_BAD_MODE = 1,
  MOESPEC_BAD_BUDGET = 2,
  MOESPEC_BAD_SCALAR = 3,  // eps <= 0 (ecospec), or a joint cost model that can predict cost <= 0
  MOESPEC_BAD_COST_TABLE = 4,
  MOESPEC_BAD_SHAPE = 5,
  MOESPEC_CUDA_ERROR = 6,
};

struct MoespecParams {
  int32_t mode;
  int32_t marginal;  // 1: new(v) = |node(v) \ B| with B growing; 0: static |E_path(v) \ root|
  int32_t use_root;  // the expert buffer starts at root_bits
  int64_t num_nodes;  // N
  int64_t num_words;  // W
  int64_t budget;  // output width and cap on selected nodes
  int64_t max_k;  // evict: min(budget, K, N)
  double token_cost, expert_cost;  // greedy key denominators
  double c0, c_tok, c_exp;  // joint cost model C(j, U) = c0 + c_tok*j + c_exp*U
};

// Per-request pointers (already offset to request b).
struct MoespecRequest {
  const float* scores;  // [N]
  const int64_t* parents;  // [N] -1 = root
  const uint8_t* valid;  // [N]
  const int64_t* depth;  // [N]
  const int64_t* node_bits;  // [N, W] per-node (layer, expert) sets
  const int64_t* root_bits;  // [W]
  const double* cost_table;  // [K+1] (evict)
  int64_t* out_idx;  // [budget]
  int64_t* out_count;  // [1]
  double* out_expected;  // [1]
  double* out_cost;  // [1]
  int64_t* ws;  // [moespec_workspace_words(N, W)]
};

MOESPEC_HD inline int64_t moespec_workspace_words(int64_t num_nodes, int64_t num_words) {
  return 3 * num_nodes + num_words + 4;
}

MOESPEC_HD inline double moespec_mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;  // host builds use -ffp-contract=off
#endif
}

MOESPEC_HD inline double moespec_add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

MOESPEC_HD inline double moespec_div(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

MOESPEC_HD inline int64_t moespec_popcount(int64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(static_cast<unsigned long long>(x));
#else
  return __builtin_popcountll(static_cast<unsigned long long>(x));
#endif
}

MOESPEC_HD inline double moespec_max(double a, double b) { return a > b ? a : b; }

// JointPolicy's greedy token cost: c_tok kept strictly positive.
MOESPEC_HD inline double moespec_joint_token_cost(double c_tok, double c_exp) {
  return moespec_max(moespec_max(c_tok, 1e-6 * moespec_max(c_exp, 1e-12)), 1e-15);
}

// Fill params from the op's scalars; the same checks as trtllm_moespec/kernels/spec.py.
MOESPEC_HD inline int32_t moespec_make_params(int32_t mode, int64_t num_nodes, int64_t num_words, int64_t budget,
                                              int64_t cost_len, double c0, double c_tok, double c_exp, double eps,
                                              MoespecParams* p) {
  if (num_nodes < 0 || num_words < 0) return MOESPEC_BAD_SHAPE;
  if (budget < 1) return MOESPEC_BAD_BUDGET;
  if (!isfinite(c0) || !isfinite(c_tok) || !isfinite(c_exp) || !isfinite(eps)) return MOESPEC_BAD_SCALAR;
  p->mode = mode;
  p->num_nodes = num_nodes;
  p->num_words = num_words;
  p->budget = budget;
  p->c0 = c0;
  p->c_tok = c_tok;
  p->c_exp = c_exp;
  p->max_k = 0;
  p->marginal = 1;
  p->use_root = 1;
  p->token_cost = eps;
  p->expert_cost = 1.0;
  const int64_t m = budget < num_nodes ? budget : num_nodes;
  switch (mode) {
    case MOESPEC_EVICT: {
      if (cost_len < 1) return MOESPEC_BAD_COST_TABLE;
      int64_t k = cost_len - 1;
      k = budget < k ? budget : k;
      p->max_k = num_nodes < k ? num_nodes : k;
      return MOESPEC_OK;
    }
    case MOESPEC_ECOSPEC:
      return eps > 0 ? MOESPEC_OK : MOESPEC_BAD_SCALAR;
    case MOESPEC_ECOSPEC_GLOBAL:
      p->marginal = 0;
      p->use_root = 0;
      return eps > 0 ? MOESPEC_OK : MOESPEC_BAD_SCALAR;
    case MOESPEC_JOINT: {
      p->token_cost = moespec_joint_token_cost(c_tok, c_exp);
      p->expert_cost = c_exp;
      const double low = c_tok * static_cast<double>(m);
      if (c_exp < 0 || !(c0 + (low < 0 ? low : 0.0) > 0)) return MOESPEC_BAD_SCALAR;
      return MOESPEC_OK;
    }
    default:
      return MOESPEC_BAD_MODE;
  }
}

// Host team: lanes of a phase run one after the other.
struct MoespecSerialTeam {
  int64_t lanes;
  template <class F>
  MOESPEC_HD void for_each(F f) const {
    for (int64_t lane = 0; lane < lanes; ++lane) f(lane, lanes);
  }
  template <class F>
  MOESPEC_HD void single(F f) const {
    f();
  }
};

// Workspace layout (int64 words).
struct MoespecWorkspace {
  int64_t* count;  // [N] new experts per node (greedy) / node of rank (evict)
  int64_t* flags;  // [N] bit 0 selected, bit 1 parent selected (or root child)
  int64_t* rank;  // [N] evict score rank
  int64_t* buffer;  // [W] expert buffer B
  int64_t* shared;  // [4] values broadcast by lane 0: [0] = picked node (-1 = none)
};

MOESPEC_HD inline MoespecWorkspace moespec_workspace(int64_t* ws, int64_t n, int64_t w) {
  MoespecWorkspace s;
  s.count = ws;
  s.flags = ws + n;
  s.rank = ws + 2 * n;
  s.buffer = ws + 3 * n;
  s.shared = ws + 3 * n + w;
  return s;
}

// A NaN score ranks below every number (as the reference's sort puts it last): the order stays total,
// so the ranks below are a permutation and every slot of ws.count is written.
MOESPEC_HD inline double moespec_rank_score(float s) { return s != s ? -INFINITY : static_cast<double>(s); }

// Does node j come before node i in (valid first, score desc, depth asc, index asc)?
MOESPEC_HD inline bool moespec_before(const MoespecRequest& r, int64_t j, int64_t i) {
  const bool vj = r.valid[j] != 0, vi = r.valid[i] != 0;
  if (vj != vi) return vj;
  if (!vi) return j < i;
  const double sj = moespec_rank_score(r.scores[j]), si = moespec_rank_score(r.scores[i]);
  if (sj != si) return sj > si;
  if (r.depth[j] != r.depth[i]) return r.depth[j] < r.depth[i];
  return j < i;
}

template <class Team>
MOESPEC_HD void moespec_select_evict(const Team& team, const MoespecRequest& r, const MoespecParams& p) {
  const int64_t n = p.num_nodes;
  MoespecWorkspace ws = moespec_workspace(r.ws, n, p.num_words);
  team.for_each([&](int64_t lane, int64_t lanes) {
    for (int64_t i = lane; i < n; i += lanes) {
      int64_t rank = 0;
      for (int64_t j = 0; j < n; ++j) rank += moespec_before(r, j, i) ? 1 : 0;
      ws.rank[i] = rank;
    }
  });
  team.single([&]() {
    int64_t num_valid = 0;
    for (int64_t i = 0; i < n; ++i) {
      num_valid += r.valid[i] ? 1 : 0;
      ws.count[ws.rank[i]] = i;  // ranks are a permutation of 0..n-1
    }
    const int64_t k_max = num_valid < p.max_k ? num_valid : p.max_k;
    double cu = 0.0, best_exp = 1.0, best_cost = r.cost_table[0];
    double best_util = moespec_div(1.0, best_cost);
    int64_t best_k = 0;
    for (int64_t k = 1; k <= k_max; ++k) {
      cu = moespec_add(cu, static_cast<double>(r.scores[ws.count[k - 1]]));
      const double expected = moespec_add(1.0, cu);
      const double util = moespec_div(expected, r.cost_table[k]);
      if (util > best_util) {
        best_util = util;
        best_k = k;
        best_exp = expected;
        best_cost = r.cost_table[k];
      }
    }
    for (int64_t i = 0; i < p.budget; ++i) r.out_idx[i] = i < best_k ? ws.count[i] : -1;
    *r.out_count = best_k;
    *r.out_expected = best_exp;
    *r.out_cost = best_cost;
  });
}

// |E_path(v) \ root| (root = 0 when !use_root) by walking v's ancestors word by word.
MOESPEC_HD inline int64_t moespec_static_new(const MoespecRequest& r, const MoespecParams& p, int64_t v) {
  const int64_t w_count = p.num_words;
  int64_t total = 0;
  for (int64_t w = 0; w < w_count; ++w) {
    int64_t acc = r.node_bits[v * w_count + w];
    // at most n ancestors, each inside the tree: a corrupt parent list (a cycle, an index past the
    // tree) ends the walk instead of hanging the kernel or reading past the buffers
    int64_t steps = 0;
    for (int64_t a = r.parents[v]; a >= 0 && a < p.num_nodes && steps < p.num_nodes; a = r.parents[a], ++steps)
      acc |= r.node_bits[a * w_count + w];
    if (p.use_root) acc &= ~r.root_bits[w];
    total += moespec_popcount(acc);
  }
  return total;
}

template <class Team>
MOESPEC_HD void moespec_select_greedy(const Team& team, const MoespecRequest& r, const MoespecParams& p) {
  const int64_t n = p.num_nodes, w_count = p.num_words;
  const int64_t m = p.budget < n ? p.budget : n;
  MoespecWorkspace ws = moespec_workspace(r.ws, n, w_count);
  team.for_each([&](int64_t lane, int64_t lanes) {
    for (int64_t w = lane; w < w_count; w += lanes) ws.buffer[w] = p.use_root ? r.root_bits[w] : 0;
    for (int64_t v = lane; v < n; v += lanes) {
      ws.flags[v] = r.parents[v] < 0 ? 2 : 0;
      ws.count[v] = (!p.marginal && r.valid[v]) ? moespec_static_new(r, p, v) : 0;
    }
  });
  // Lane 0's running state (only lane 0 reads or writes these).
  double cu = 0.0, best_util = -INFINITY, best_exp = 1.0, best_cost = NAN;
  int64_t unique = 0, num_sel = 0, best_j = 0;
  team.single([&]() {
    for (int64_t w = 0; w < w_count; ++w) unique += moespec_popcount(ws.buffer[w]);
    if (p.mode == MOESPEC_JOINT) {
      best_cost = moespec_add(moespec_add(p.c0, moespec_mul(p.c_tok, 0.0)),
                              moespec_mul(p.c_exp, static_cast<double>(unique)));
      best_util = moespec_div(1.0, best_cost);
    }
  });
  for (int64_t round = 0; round < m; ++round) {
    if (p.marginal) {
      team.for_each([&](int64_t lane, int64_t lanes) {
        for (int64_t v = lane; v < n; v += lanes) {
          if (ws.flags[v] != 2 || !r.valid[v]) continue;  // only candidates: unselected, parent selected
          int64_t fresh = 0;
          for (int64_t w = 0; w < w_count; ++w) fresh += moespec_popcount(r.node_bits[v * w_count + w] & ~ws.buffer[w]);
          ws.count[v] = fresh;
        }
      });
    }
    team.single([&]() {
      int64_t pick = -1;
      double best_key = 0.0;
      for (int64_t v = 0; v < n; ++v) {
        if (ws.flags[v] != 2 || !r.valid[v]) continue;
        const double den = moespec_add(p.token_cost, moespec_mul(p.expert_cost, static_cast<double>(ws.count[v])));
        const double key = moespec_div(static_cast<double>(r.scores[v]), den);
        if (pick < 0 || key > best_key) {
          pick = v;
          best_key = key;
        }
      }
      ws.shared[0] = pick;
      if (pick < 0) return;
      r.out_idx[num_sel] = pick;
      cu = moespec_add(cu, static_cast<double>(r.scores[pick]));
      unique += ws.count[pick];
      num_sel += 1;
      if (p.mode == MOESPEC_JOINT) {
        const double cost = moespec_add(moespec_add(p.c0, moespec_mul(p.c_tok, static_cast<double>(num_sel))),
                                        moespec_mul(p.c_exp, static_cast<double>(unique)));
        const double util = moespec_div(moespec_add(1.0, cu), cost);
        if (util > best_util) {
          best_util = util;
          best_j = num_sel;
          best_exp = moespec_add(1.0, cu);
          best_cost = cost;
        }
      }
    });
    const int64_t pick = ws.shared[0];
    if (pick < 0) break;
    team.for_each([&](int64_t lane, int64_t lanes) {
      for (int64_t w = lane; w < w_count; w += lanes) ws.buffer[w] |= r.node_bits[pick * w_count + w];
      for (int64_t v = lane; v < n; v += lanes) {
        if (v == pick) ws.flags[v] |= 1;
        if (r.parents[v] == pick) ws.flags[v] |= 2;
      }
    });
  }
  team.single([&]() {
    if (p.mode != MOESPEC_JOINT) {
      best_j = num_sel;
      best_exp = moespec_add(1.0, cu);
    }
    for (int64_t i = 0; i < p.budget; ++i) {
      if (i >= best_j) r.out_idx[i] = -1;  // entries < best_j hold the greedy order
    }
    *r.out_count = best_j;
    *r.out_expected = best_exp;
    *r.out_cost = best_cost;
  });
}

template <class Team>
MOESPEC_HD void moespec_select_request(const Team& team, const MoespecRequest& r, const MoespecParams& p) {
  if (p.mode == MOESPEC_EVICT) {
    moespec_select_evict(team, r, p);
  } else {
    moespec_select_greedy(team, r, p);
  }
}
