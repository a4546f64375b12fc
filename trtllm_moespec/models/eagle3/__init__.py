"""The EAGLE-3 drafter: its network, per-request cache, checkpoint I/O, static-shape forwards and their
CUDA graphs, and tree drafting. Layered one way, each module importing only those above it here:

- `types.py`: Eagle3Config, Eagle3Output, PackedSegment (shared by every layer below)
- `cache.py`: Eagle3Cache (per-request K/V) and DrafterKVPool (buffers reused across requests)
- `layers.py`: RMSNorm, the attention / MLP modules, rotary, fused weights, causal_mask
- `modeling.py`: Eagle3Drafter (forward, packed forward, prefill / extend / commit)
- `loading.py`: load_eagle3, write_random_drafter
- `static.py`: the static-shape drafter forward a CUDA graph captures
- `graphs.py`: its runners and CUDA graphs (extensions, tree-drafting steps), kept per K/V buffer
- `fused_step.py`: a drafting step's host bookkeeping as one numba-compiled call (CPU)
- `drafting.py`: tree drafting (draft_eagle3_tree / draft_eagle3_trees), optionally through graphs.py

The one call upward is `Eagle3Drafter.draft_tree`, which imports drafting.py when called (drafting
needs modeling only for annotations). tests/test_import_graph.py keeps this order.
"""

from .cache import DrafterKVPool, Eagle3Cache
from .drafting import Eagle3Draft, draft_eagle3_tree, draft_eagle3_trees
from .layers import causal_mask
from .loading import load_eagle3, write_random_drafter
from .modeling import Eagle3Drafter
from .types import EAGLE3_ARCHITECTURES, Eagle3Config, Eagle3Output, PackedSegment

__all__ = [
    "EAGLE3_ARCHITECTURES", "DrafterKVPool", "Eagle3Cache", "Eagle3Config", "Eagle3Draft", "Eagle3Drafter",
    "Eagle3Output", "PackedSegment", "causal_mask", "draft_eagle3_tree", "draft_eagle3_trees", "load_eagle3",
    "write_random_drafter",
]
