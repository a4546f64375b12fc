"""Engine configuration: the draft-tree shape."""

from __future__ import annotations

from dataclasses import dataclass

# Drafting keeps every expanded candidate and verification builds masks over the selected nodes
# (quadratic in their number), so the tree is bounded before anything is allocated: a typo such as
# 4,8,100000 used to reach a 10 GB mask allocation and the OOM killer.
MAX_TREE_NODES = 4096


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-style drafting shape and the verification cap (EVICT paper default: 4 / 8 / 32)."""

    steps: int = 4  # drafter forwards per iteration (tree depth)
    topk: int = 8  # children per expanded node and frontier width
    max_draft_tokens: int = 32  # most draft nodes any policy may verify in one step

    def __post_init__(self) -> None:
        for name in ("steps", "topk", "max_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TreeConfig.{name} must be a positive integer, got {value!r}")
        if self.num_tree_nodes > MAX_TREE_NODES:
            raise ValueError(f"tree {self.steps},{self.topk},{self.max_draft_tokens} drafts topk + (steps-1)*topk^2 = "
                             f"{self.num_tree_nodes} nodes per step; the limit is {MAX_TREE_NODES}")
        if self.max_draft_tokens > self.num_tree_nodes:
            raise ValueError(f"tree {self.steps},{self.topk},{self.max_draft_tokens}: max_draft_tokens "
                             f"{self.max_draft_tokens} exceeds the {self.num_tree_nodes} nodes the tree drafts "
                             f"(max_draft_tokens <= topk + (steps-1)*topk^2)")

    @property
    def num_tree_nodes(self) -> int:
        """Nodes of the full well-structured tree: topk + (steps - 1) * topk^2."""
        return self.topk + (self.steps - 1) * self.topk * self.topk

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.steps, self.topk, self.max_draft_tokens)

    @staticmethod
    def parse(text: str) -> "TreeConfig":
        """'steps,topk,max_draft_tokens' (the CLI form)."""
        try:
            steps, topk, max_draft = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"tree must be 'steps,topk,max_draft_tokens' (e.g. 4,8,32), got {text!r}") from None
        return TreeConfig(steps, topk, max_draft)
