// MoESpecTreeSelect attributes and their 48-byte serialised form, shared by the
// native plugin and tested against trtllm_moespec/backends/trt_plugin/spec.py
// (serialize_attrs). No TensorRT dependency.
//   layout (little endian): char magic[4] = "MSTS"; uint32 version = 1; int32 mode;
//   int32 budget; double c0, c_tok, c_exp, eps
#pragma once

#include <stdint.h>
#include <string.h>

struct MoespecPluginAttrs {
  int32_t mode;  // 0 evict, 1 ecospec, 2 ecospec_global, 3 joint
  int32_t budget;
  double c0, c_tok, c_exp, eps;
};

static const size_t kMoespecAttrsBytes = 48;
static const uint32_t kMoespecAttrsVersion = 1;

inline void moespec_attrs_pack(const MoespecPluginAttrs& a, unsigned char* out) {
  memcpy(out, "MSTS", 4);
  memcpy(out + 4, &kMoespecAttrsVersion, 4);
  memcpy(out + 8, &a.mode, 4);
  memcpy(out + 12, &a.budget, 4);
  memcpy(out + 16, &a.c0, 8);
  memcpy(out + 24, &a.c_tok, 8);
  memcpy(out + 32, &a.c_exp, 8);
  memcpy(out + 40, &a.eps, 8);
}

// Returns false on a wrong size, magic or version.
inline bool moespec_attrs_unpack(const void* data, size_t size, MoespecPluginAttrs* a) {
  const unsigned char* in = static_cast<const unsigned char*>(data);
  uint32_t version = 0;
  if (size != kMoespecAttrsBytes || memcmp(in, "MSTS", 4) != 0) return false;
  memcpy(&version, in + 4, 4);
  if (version != kMoespecAttrsVersion) return false;
  memcpy(&a->mode, in + 8, 4);
  memcpy(&a->budget, in + 12, 4);
  memcpy(&a->c0, in + 16, 8);
  memcpy(&a->c_tok, in + 24, 8);
  memcpy(&a->c_exp, in + 32, 8);
  memcpy(&a->eps, in + 40, 8);
  return true;
}
