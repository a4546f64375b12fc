"""`python -m benchmarks.run ...` == `moespec bench ...` (see trtllm_moespec/bench)."""

import sys

from trtllm_moespec.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks.run"))
