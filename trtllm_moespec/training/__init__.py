"""Training of the embedded default model family ``moespec-tiny``.

One concept per module: ``corpus`` (stdlib sources, split by file), ``tokenizer``
(byte-level BPE), ``data`` (token streams and batches), ``target`` (the
Qwen3-MoE configuration), ``train_target`` (the time-bounded, resumable training
loop), ``routing`` (router traces through forward hooks), ``train_predictor``
(the EcoSpec standalone expert predictor) and ``cost_probe`` (C(k) and unique
experts vs k). Driven by ``build_scripts/train_model.py``.
"""
