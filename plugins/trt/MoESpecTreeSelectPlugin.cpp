// Native TensorRT (10.x, IPluginV3) plugin "MoESpecTreeSelect" over the CUDA
// selection kernels of ../tree_select. I/O and attributes: see
// trtllm_moespec/backends/trt_plugin/spec.py (the tested contract).
//   inputs  scores [B,N] f32, parents [B,N] i64, valid [B,N] bool, depth [B,N] i64,
//           node_bits [B,N,W] i64, root_bits [B,W] i64, cost_table [K+1] f32
//   outputs node_idx [B,budget] i64, num_selected [B] i64, expected_tokens [B] f32,
//           predicted_cost [B] f32
// Build with CMakeLists.txt in this folder; load with IPluginRegistry::loadLibrary
// (or trtexec --dynamicPlugins=...), which calls getCreators() below.
#include <NvInferRuntime.h>

#include <cstring>
#include <vector>

#include "tree_select_attrs.h"
#include "tree_select_plugin_kernels.h"

using namespace nvinfer1;

namespace {

char const* const kName = "MoESpecTreeSelect";
char const* const kVersion = "1";
char const* const kNamespace = "moespec";
constexpr int32_t kNbInputs = 7;
constexpr int32_t kNbOutputs = 4;

class MoESpecTreeSelectPlugin : public IPluginV3,
                                public IPluginV3OneCore,
                                public IPluginV3OneBuild,
                                public IPluginV3OneRuntime {
 public:
  explicit MoESpecTreeSelectPlugin(MoespecPluginAttrs const& attrs) : mAttrs(attrs) { initFields(); }
  MoESpecTreeSelectPlugin(MoESpecTreeSelectPlugin const& other) : mAttrs(other.mAttrs) { initFields(); }

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    if (type == PluginCapabilityType::kBUILD) return static_cast<IPluginV3OneBuild*>(this);
    if (type == PluginCapabilityType::kRUNTIME) return static_cast<IPluginV3OneRuntime*>(this);
    return static_cast<IPluginV3OneCore*>(this);
  }
  IPluginV3* clone() noexcept override { return new (std::nothrow) MoESpecTreeSelectPlugin(*this); }

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override { return kName; }
  char const* getPluginVersion() const noexcept override { return kVersion; }
  char const* getPluginNamespace() const noexcept override { return kNamespace; }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return kNbOutputs; }

  int32_t configurePlugin(DynamicPluginTensorDesc const*, int32_t nbInputs, DynamicPluginTensorDesc const*,
                          int32_t nbOutputs) noexcept override {
    return (nbInputs == kNbInputs && nbOutputs == kNbOutputs) ? 0 : -1;
  }

  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs) return false;
    static DataType const kTypes[kNbInputs + kNbOutputs] = {
        DataType::kFLOAT, DataType::kINT64, DataType::kBOOL, DataType::kINT64, DataType::kINT64, DataType::kINT64,
        DataType::kFLOAT, DataType::kINT64, DataType::kINT64, DataType::kFLOAT, DataType::kFLOAT};
    return inOut[pos].desc.format == TensorFormat::kLINEAR && inOut[pos].desc.type == kTypes[pos];
  }

  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const*,
                             int32_t nbInputs) const noexcept override {
    if (nbOutputs != kNbOutputs || nbInputs != kNbInputs) return -1;
    outputTypes[0] = DataType::kINT64;
    outputTypes[1] = DataType::kINT64;
    outputTypes[2] = DataType::kFLOAT;
    outputTypes[3] = DataType::kFLOAT;
    return 0;
  }

  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* outputs,
                          int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept override {
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs) return -1;
    static int32_t const kRanks[kNbInputs] = {2, 2, 2, 2, 3, 2, 1};
    for (int32_t i = 0; i < kNbInputs; ++i) {
      if (inputs[i].nbDims != kRanks[i]) return -1;
    }
    IDimensionExpr const* batch = inputs[0].d[0];
    outputs[0].nbDims = 2;
    outputs[0].d[0] = batch;
    outputs[0].d[1] = exprBuilder.constant(mAttrs.budget);
    for (int32_t o = 1; o < kNbOutputs; ++o) {
      outputs[o].nbDims = 1;
      outputs[o].d[0] = batch;
    }
    return 0;
  }

  size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs, DynamicPluginTensorDesc const*,
                          int32_t) const noexcept override {
    if (nbInputs != kNbInputs) return 0;
    return moespec_trt_workspace_bytes(inputs[0].max.d[0], inputs[0].max.d[1], inputs[4].max.d[2],
                                       inputs[6].max.d[0]);
  }

  // IPluginV3OneRuntime
  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*, void const* const* inputs,
                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
    int64_t const batch = inputDesc[0].dims.d[0];
    int64_t const num_nodes = inputDesc[0].dims.d[1];
    int64_t const num_words = inputDesc[4].dims.d[2];
    int64_t const cost_len = inputDesc[6].dims.d[0];
    return moespec_trt_enqueue(
        batch, num_nodes, num_words, cost_len, static_cast<float const*>(inputs[0]),
        static_cast<int64_t const*>(inputs[1]), static_cast<uint8_t const*>(inputs[2]),
        static_cast<int64_t const*>(inputs[3]), static_cast<int64_t const*>(inputs[4]),
        static_cast<int64_t const*>(inputs[5]), static_cast<float const*>(inputs[6]), mAttrs.mode, mAttrs.budget,
        mAttrs.c0, mAttrs.c_tok, mAttrs.c_exp, mAttrs.eps, static_cast<int64_t*>(outputs[0]),
        static_cast<int64_t*>(outputs[1]), static_cast<float*>(outputs[2]), static_cast<float*>(outputs[3]),
        workspace, stream);
  }

  int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override {
    return 0;
  }

  IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &mFieldCollection; }

 private:
  void initFields() {
    moespec_attrs_pack(mAttrs, mSerialized);
    mFields.clear();
    mFields.emplace_back("attrs", mSerialized, PluginFieldType::kUNKNOWN, static_cast<int32_t>(kMoespecAttrsBytes));
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
  }

  MoespecPluginAttrs mAttrs;
  unsigned char mSerialized[kMoespecAttrsBytes];
  std::vector<PluginField> mFields;
  PluginFieldCollection mFieldCollection{};
};

class MoESpecTreeSelectCreator : public IPluginCreatorV3One {
 public:
  MoESpecTreeSelectCreator() {
    mFieldNames.emplace_back("mode", nullptr, PluginFieldType::kINT32, 1);
    mFieldNames.emplace_back("budget", nullptr, PluginFieldType::kINT32, 1);
    mFieldNames.emplace_back("c0", nullptr, PluginFieldType::kFLOAT64, 1);
    mFieldNames.emplace_back("c_tok", nullptr, PluginFieldType::kFLOAT64, 1);
    mFieldNames.emplace_back("c_exp", nullptr, PluginFieldType::kFLOAT64, 1);
    mFieldNames.emplace_back("eps", nullptr, PluginFieldType::kFLOAT64, 1);
    mFieldNames.emplace_back("attrs", nullptr, PluginFieldType::kUNKNOWN, static_cast<int32_t>(kMoespecAttrsBytes));
    mFieldCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
    mFieldCollection.fields = mFieldNames.data();
  }

  char const* getPluginName() const noexcept override { return kName; }
  char const* getPluginVersion() const noexcept override { return kVersion; }
  char const* getPluginNamespace() const noexcept override { return kNamespace; }
  PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldCollection; }

  // Build phase: typed fields (mode and budget required). Runtime: the serialised "attrs" blob.
  IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
    MoespecPluginAttrs attrs{-1, 0, 0.0, 0.0, 0.0, 1e-3};
    for (int32_t i = 0; i < fc->nbFields; ++i) {
      PluginField const& f = fc->fields[i];
      if (std::strcmp(f.name, "attrs") == 0) {
        if (!moespec_attrs_unpack(f.data, static_cast<size_t>(f.length), &attrs)) return nullptr;
      } else if (std::strcmp(f.name, "mode") == 0 && f.type == PluginFieldType::kINT32) {
        attrs.mode = *static_cast<int32_t const*>(f.data);
      } else if (std::strcmp(f.name, "budget") == 0 && f.type == PluginFieldType::kINT32) {
        attrs.budget = *static_cast<int32_t const*>(f.data);
      } else if (f.type == PluginFieldType::kFLOAT64) {
        double const v = *static_cast<double const*>(f.data);
        if (std::strcmp(f.name, "c0") == 0) attrs.c0 = v;
        else if (std::strcmp(f.name, "c_tok") == 0) attrs.c_tok = v;
        else if (std::strcmp(f.name, "c_exp") == 0) attrs.c_exp = v;
        else if (std::strcmp(f.name, "eps") == 0) attrs.eps = v;
        else return nullptr;
      } else {
        return nullptr;  // unknown field or wrong type
      }
    }
    if (attrs.mode < 0 || attrs.mode > 3 || attrs.budget < 1) return nullptr;
    return new (std::nothrow) MoESpecTreeSelectPlugin(attrs);
  }

 private:
  std::vector<PluginField> mFieldNames;
  PluginFieldCollection mFieldCollection{};
};

}  // namespace

// Entry points TensorRT looks up when a plugin library is loaded (IPluginRegistry::loadLibrary).
extern "C" TENSORRTAPI void setLoggerFinder(ILoggerFinder*) {}  // the plugin logs nothing

extern "C" TENSORRTAPI IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static MoESpecTreeSelectCreator creator;
  static IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}
