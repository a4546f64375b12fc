"""TensorRT-LLM field names we generate, as verified in its sources, and a validator.

Everything we write for TensorRT-LLM (the `extra_llm_api_options` YAML files of an
engine directory) is checked against the allowed key sets below, so a typo or a
field that the pinned version does not know fails here, on CPU, instead of on a
GPU node. The sets hold only the fields we emit or accept, not all of TensorRT-LLM.

Where they were read (NVIDIA/TensorRT-LLM; the source index stores file versions by commit,
without release tags). The backend README's citation table lists the same sources;
tests/backends/fixtures/trtllm/ pins verbatim excerpts that tests check this module against.
- `tensorrt_llm/llmapi/llm_args.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412 (excerpt pinned):
  * DecodingBaseConfig: max_draft_len, max_total_draft_tokens, speculative_model
    (validation alias `speculative_model_dir`, the name we emit), use_rejection_sampling
    (default False), draft_len_schedule (the host picks the draft length from the batch size).
  * EagleDecodingConfig: eagle_choices, greedy_sampling, posterior_threshold,
    use_dynamic_tree, dynamic_tree_max_topK, num_eagle_layers,
    max_non_leaves_per_layer, eagle3_one_model, eagle3_layers_to_capture
    (default {1, L//2-1, L-4}: layer *outputs*, i.e. inputs of layers 2, L//2, L-3).
    Its validator requires, for a dynamic tree, dynamic_tree_max_topK > 0 and
    max_draft_len <= max_total_draft_tokens <= dynamic_tree_max_topK * max_draft_len.
  * Eagle3DecodingConfig(EagleDecodingConfig): decoding_type "Eagle3"; `_max_batch_size`
    is a private attribute TensorRT-LLM fills (the dynamic-tree worker's "private" contract).
  * BaseCudaGraphConfig: batch_sizes, max_batch_size, enable_padding (max_batch_size
    must equal max(batch_sizes) when both are given).
  * MoeConfig: backend, one of MOE_BACKENDS (default "AUTO").
  * LLM args (tensor_parallel_size, pipeline_parallel_size, moe_expert_parallel_size,
    moe_tensor_parallel_size, max_batch_size, max_num_tokens, max_seq_len, dtype,
    kv_cache_config, cuda_graph_config, speculative_config, enable_attention_dp,
    disable_overlap_scheduler, backend, moe_config) and KvCacheConfig
    (free_gpu_memory_fraction, enable_block_reuse, max_tokens): as recorded by the earlier
    reviews of this file; not in the pinned excerpt, so not re-checked against upstream text.
- `tensorrt_llm/mapping.py` @ b35ac1b64368513d215c57d2ed01d62d910df8da (the 1.2.0rc2 commit):
  `MappingBase.__init__` raises unless moe_tp_size * moe_ep_size * moe_cluster_size equals the
  MoE world (tp_size without context parallelism); `ep_experts` gives each EP rank
  num_experts // moe_ep_size experts.
- `tensorrt_llm/_torch/speculative/eagle3_dynamic_tree.py` @ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc:
  buffer shapes used by `buffers.py` (documented there); `_forward_draft_loop` calls
  `update_hidden_states(0, batch_size, step0_hs=..)` after step 0 (step0_hs = the pre-norm
  `hidden_states_to_save` at gather_ids, the last accepted position) and
  `update_hidden_states(l, batch_size, hidden_states_to_save=.., selected_parents=..)` after
  step l >= 1, whose last K rows per request are the step's frontier; `prepare_for_generation(
  0, .., inputs=inputs, gather_ids=gather_ids, ..)` sees the step-0 input ids; then
  `resampling_final_draft_tokens(batch_size)`, inside the captured one-model forward.
- `triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt` @ 0a71057313ec0626527e164a8fc0205c5822e2f5:
  Triton tensor names (`text_input`, `streaming`, `sampling_param_*`, `text_output`,
  `acceptance_rate`, `total_accepted_draft_tokens`, `total_draft_tokens`); `1/model.yaml` @
  0ebb1536ac12bbe27201185de960df3ab00bcecc: the `triton_config` block (as recorded earlier).
- Version lines (version.py): `eagle3_dynamic_tree.py` exists @ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc
  and @ 470bb72055d5d397c60be4dda1e8f490e7002440 and is imported by `_torch/speculative/utils.py` @
  011d0933dcb5e592f5fa2626beaf42a96324c578, while utils.py @ 3e906a0ed7c66ed4df90aa4856bf1a6c98ca7df6
  builds only `Eagle3OneModelWorker`. The 1.2 line is represented by b35ac1b64368513d215c57d2ed01d62d910df8da
  (`tensorrt_llm/version.py` = "1.2.0rc2"). The PR numbers (#12062, #13006, #13081, #15842) and
  the 1.2.x `validate_eagle_config` rule `max_total_draft_tokens = max_draft_len` are as recorded by
  the review in issue 11, not re-read at a named commit here; `check_effective_draft_tokens`
  checks the effective sizes on the built LLM instead of trusting that record.
- `tensorrt_llm/_torch/speculative/utils.py` @ 011d0933dcb5e592f5fa2626beaf42a96324c578 (excerpt
  pinned): `_is_effective_dynamic_tree(spec_config)` = use_dynamic_tree and dynamic_tree_max_topK
  > 1, used by `get_spec_worker`, `get_spec_metadata` and `get_spec_resource_manager`, so
  worker.py defers to it when present and mirrors it otherwise.
- `tensorrt_llm/_torch/models/modeling_speculative.py` @ 00679c66c3e38f6d2651ad0a5bef0f94d862e36c:
  `Eagle3DraftModel.forward` returns (post-norm hidden, pre-norm `hidden_states_to_save`) unless
  `eagle_config.return_hidden_post_norm` or `norm_output` is set; `embed_tokens` is the target's
  (`load_weights_from_target_model`) unless the drafter's width differs from the target's.
- `tensorrt_llm/executor/executor.py` @ ed53795b33fc139493f762a1c6c53f691cf52d38:
  `GenerationExecutor.create` builds the in-process `GenerationExecutorWorker` only when
  `enable_worker_single_process_for_tp1()` (env `TLLM_WORKER_USE_SINGLE_PROCESS`) or
  return_logits; otherwise a single GPU gets a `GenerationExecutorProxy` whose worker runs in a
  process spawned through mpi4py (`mpi_session=None`), and a model world size > 1 without
  mpirun spawns MPI workers through the `mpi_session` it is given.
- `triton_backend/all_models/llmapi/tensorrt_llm/1/model.py` @ 044a90d209e380c95e23e8ae42f3583fa05ada78:
  deletes inherited MPI job variables at import; rank 0 builds the LLM (`generate_async`, a
  response thread); the model file is `os.environ.get('LLM_CONFIG_PATH', 'model.yaml')`.
- `tensorrt_llm/python_plugin.py` @ 18b5fac4f805b04f15efff9962db4a0f0453e4aa (excerpt pinned) and
  `tensorrt_llm/_utils.py` @ ed53795b33fc139493f762a1c6c53f691cf52d38: see TRTLLM_MODULE_LAYOUT below.
"""

from __future__ import annotations

from typing import Any, Mapping

# The tensorrt_llm lines the adapter is written against (PEP 440 bounds; policy in version.py).
CHAIN_LINE_MIN, CHAIN_LINE_MAX = "1.2.0", "1.3.0.dev0"  # 1.2.x: linear EAGLE-3 only (1.3 pre-releases excluded)
TREE_LINE_MIN, TREE_LINE_MAX = "1.3.0.dev0", "2.0.0"  # needs DYNAMIC_TREE_MODULE too (PR #13081)
CHAIN_LINE_RANGE = f">={CHAIN_LINE_MIN},<{CHAIN_LINE_MAX}"
CHAIN_ENGINE_RANGE = f">={CHAIN_LINE_MIN},<{TREE_LINE_MAX}"  # linear EAGLE-3 runs on both lines
TREE_LINE_RANGE = f">={TREE_LINE_MIN},<{TREE_LINE_MAX}"
DYNAMIC_TREE_MODULE = "tensorrt_llm._torch.speculative.eagle3_dynamic_tree"

# Where the names our Python plugin imports are defined (module -> names), so an import
# from the wrong module fails a CPU test instead of a GPU node:
# - python_plugin.py @ 18b5fac4f805b04f15efff9962db4a0f0453e4aa: defines PluginBase, SymTensor, ShapeExpr, DimensionExpr,
#   trtllm_plugin (whose plugin_namespace defaults to TRT_LLM_PLUGIN_NAMESPACE, imported from
#   .plugin.plugin); it imports TensorWrapper and trt_dtype_to_torch from ._utils but not
#   convert_to_torch_tensor.
# - _utils.py @ ed53795b33fc139493f762a1c6c53f691cf52d38: defines TensorWrapper, convert_to_torch_tensor, trt_dtype_to_torch.
TRTLLM_MODULE_LAYOUT = {
    "tensorrt_llm.python_plugin": frozenset({"PluginBase", "SymTensor", "ShapeExpr", "DimensionExpr", "trtllm_plugin"}),
    "tensorrt_llm._utils": frozenset({"TensorWrapper", "convert_to_torch_tensor", "trt_dtype_to_torch"}),
    "tensorrt_llm.plugin.plugin": frozenset({"TRT_LLM_PLUGIN_NAMESPACE"}),
}

SPECULATIVE_CONFIG_FIELDS = frozenset(
    {
        "decoding_type",
        "max_draft_len",
        "max_total_draft_tokens",
        "speculative_model",
        "speculative_model_dir",
        "use_rejection_sampling",
        "eagle_choices",
        "greedy_sampling",
        "posterior_threshold",
        "use_dynamic_tree",
        "dynamic_tree_max_topK",
        "num_eagle_layers",
        "max_non_leaves_per_layer",
        "eagle3_one_model",
        "eagle3_layers_to_capture",
        # Only for the dynamic-tree worker of eagle3_dynamic_tree.py @ 470bb72055d5d397c60be4dda1e8f490e7002440, which
        # reads it from the speculative config (config.with_batch_contract adds it at run time, never in the YAML).
        "max_batch_size",
    }
)
EAGLE3_DECODING_TYPE = "Eagle3"

CUDA_GRAPH_CONFIG_FIELDS = frozenset({"batch_sizes", "max_batch_size", "enable_padding"})

KV_CACHE_CONFIG_FIELDS = frozenset({"free_gpu_memory_fraction", "enable_block_reuse", "max_tokens"})

LLM_ARGS_FIELDS = frozenset(
    {
        "backend",
        "dtype",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "moe_expert_parallel_size",
        "moe_tensor_parallel_size",
        "enable_attention_dp",
        "max_batch_size",
        "max_num_tokens",
        "max_seq_len",
        "kv_cache_config",
        "cuda_graph_config",
        "speculative_config",
        "disable_overlap_scheduler",
        "moe_config",
    }
)

# MoeConfig (llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412): `backend` is one of these (default "AUTO").
MOE_CONFIG_FIELDS = frozenset({"backend"})
MOE_BACKENDS = ("AUTO", "CUTLASS", "CUTEDSL", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA", "TRITON", "MARLIN",
                "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL")

# Triton llmapi model (triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @
# 0a71057313ec0626527e164a8fc0205c5822e2f5):
# request inputs and outputs we mirror.
TRITON_LLMAPI_INPUTS = frozenset(
    {
        "text_input",
        "streaming",
        "sampling_param_temperature",
        "sampling_param_top_k",
        "sampling_param_top_p",
        "sampling_param_frequency_penalty",
        "sampling_param_presence_penalty",
        "sampling_param_max_tokens",
        "sampling_param_stop",
        "sampling_param_seed",
    }
)
TRITON_LLMAPI_OUTPUTS = frozenset({"text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"})
TRITON_CONFIG_FIELDS = frozenset({"max_batch_size", "decoupled"})


def _check_keys(section: str, data: Mapping[str, Any], allowed: frozenset[str]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{section} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{section}: unknown TensorRT-LLM field(s) {unknown}; allowed: {sorted(allowed)}")


def validate_speculative_config(spec: Mapping[str, Any]) -> None:
    """Check an Eagle3 speculative_config mapping as TensorRT-LLM's validators would."""
    _check_keys("speculative_config", spec, SPECULATIVE_CONFIG_FIELDS)
    if spec.get("decoding_type") != EAGLE3_DECODING_TYPE:
        raise ValueError(f"speculative_config.decoding_type must be {EAGLE3_DECODING_TYPE!r}, got {spec.get('decoding_type')!r}")
    if not (spec.get("speculative_model_dir") or spec.get("speculative_model")):
        raise ValueError("speculative_config needs speculative_model_dir (the EAGLE-3 draft checkpoint)")
    draft_len = spec.get("max_draft_len")
    if not isinstance(draft_len, int) or draft_len <= 0:
        raise ValueError(f"speculative_config.max_draft_len must be a positive int, got {draft_len!r}")
    total = spec.get("max_total_draft_tokens", draft_len)
    if spec.get("use_dynamic_tree"):
        topk = spec.get("dynamic_tree_max_topK")
        if not isinstance(topk, int) or topk <= 0:
            raise ValueError(f"dynamic tree needs dynamic_tree_max_topK > 0, got {topk!r}")
        if not draft_len <= total <= topk * draft_len:
            raise ValueError(
                f"max_total_draft_tokens={total} must lie in [max_draft_len={draft_len}, "
                f"dynamic_tree_max_topK*max_draft_len={topk * draft_len}]"
            )
    elif total != draft_len:
        raise ValueError(f"a linear (chain) draft needs max_total_draft_tokens == max_draft_len, got {total} != {draft_len}")
    layers = spec.get("eagle3_layers_to_capture")
    if layers is not None and (not isinstance(layers, (list, set, tuple)) or not all(isinstance(x, int) for x in layers)):
        raise ValueError(f"eagle3_layers_to_capture must be a list of ints, got {layers!r}")


def validate_cuda_graph_config(cfg: Mapping[str, Any]) -> None:
    _check_keys("cuda_graph_config", cfg, CUDA_GRAPH_CONFIG_FIELDS)
    sizes = cfg.get("batch_sizes")
    if sizes is not None:
        if not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise ValueError(f"cuda_graph_config.batch_sizes must be positive ints, got {sizes!r}")
        if cfg.get("max_batch_size", max(sizes)) != max(sizes):
            raise ValueError("cuda_graph_config.max_batch_size must equal max(batch_sizes)")


def validate_llm_api_options(options: Mapping[str, Any]) -> None:
    """Validate an `extra_llm_api_options` mapping; raises ValueError naming the problem."""
    _check_keys("llm_api_options", options, LLM_ARGS_FIELDS)
    if "speculative_config" in options:
        validate_speculative_config(options["speculative_config"])
    if options.get("cuda_graph_config") is not None:  # null disables CUDA graphs
        validate_cuda_graph_config(options["cuda_graph_config"])
    if "kv_cache_config" in options:
        _check_keys("kv_cache_config", options["kv_cache_config"], KV_CACHE_CONFIG_FIELDS)
    if "moe_config" in options:
        _check_keys("moe_config", options["moe_config"], MOE_CONFIG_FIELDS)
        if options["moe_config"].get("backend") not in MOE_BACKENDS:
            raise ValueError(f"moe_config.backend {options['moe_config'].get('backend')!r} is not one of {MOE_BACKENDS}")
    tp = options.get("tensor_parallel_size", 1)
    ep = options.get("moe_expert_parallel_size")
    moe_tp = options.get("moe_tensor_parallel_size")
    if ep is not None and moe_tp is not None and ep * moe_tp != tp:
        raise ValueError(f"moe_tensor_parallel_size*moe_expert_parallel_size = {moe_tp}*{ep} must equal tensor_parallel_size={tp}")
