"""The model-free core: draft trees, selection policies, verification and cost models.

Imports only torch and numpy (a test pins this), so every backend can reuse it.
"""

from .cost import CostTable, ExpertCostModel, RooflineCostModel
from .experts import ExpertSets, num_words, popcount
from .layout import TreeLayout, build_layout
from .policies import POLICIES, Selection, SelectionPolicy, ddd_should_stop, make_policy
from .presets import ARCHITECTURES, DEVICES, DevicePreset, MoEArchitecture, architecture
from .sampling import SamplingConfig, sample_from_probs, target_probs
from .tree import DraftTree, draft_root, grow_tree, limit_depth, score_order, top_k_nodes
from .verify import VerifyResult, draw_uniforms, verify_tree, verify_tree_reference

__all__ = [
    "ARCHITECTURES", "DEVICES", "POLICIES", "CostTable", "DevicePreset", "DraftTree", "ExpertCostModel", "ExpertSets",
    "MoEArchitecture", "RooflineCostModel", "SamplingConfig", "Selection", "SelectionPolicy", "TreeLayout",
    "VerifyResult", "architecture", "build_layout", "ddd_should_stop", "draft_root", "draw_uniforms", "grow_tree",
    "limit_depth", "make_policy", "num_words", "popcount", "sample_from_probs", "score_order", "target_probs", "top_k_nodes",
    "verify_tree", "verify_tree_reference",
]
