"""TensorRT-LLM adapter: engine-directory configuration, buffer translation, the MoESpec worker.

Modules: `schema` (verified TensorRT-LLM field names), `presets` (model facts),
`config` (profiles and llm_api_options), `buffers` (dynamic-tree buffers <->
DraftTree), `worker` (the Eagle3 dynamic-tree worker subclass and `install()`),
`version` (supported tensorrt_llm range). None imports tensorrt_llm at import time.
"""
