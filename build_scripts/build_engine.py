#!/usr/bin/env python
"""Write a MoESpec engine directory for TensorRT-LLM (same as `moespec build`).

    python build_scripts/build_engine.py --model gpt-oss-120b --draft-model DIR --checkpoint DIR \\
        --policy joint --tp 8 --ep 8 --max-batch-size 8 --verify-lengths 4,8,16,32 --out engines/gpt-oss-120b

The logic lives in trtllm_moespec.backends.trtllm.build so the installed `moespec`
command can use it; this script re-exports add_build_arguments, build_engine, main.
"""

import sys

from trtllm_moespec.backends.trtllm.build import add_build_arguments, build_engine, main

__all__ = ["add_build_arguments", "build_engine", "main"]

if __name__ == "__main__":
    sys.exit(main())
