"""Draft trees and SGLang-compatible tree tensors. Knows nothing about caches or models."""
from .build import BuiltTree, OrganizedDraft, build_tree, links_from_parents, organize_draft_results
from .convert import tensors_to_trees, trees_to_tensors
from .draft_tree import DraftTree
from .greedy import GreedyResult, parents_from_links, verify_tree_greedy
from .masks import TreeMaskMode, make_tree_mask, unpack_bits

__all__ = [
    "BuiltTree", "DraftTree", "GreedyResult", "OrganizedDraft", "TreeMaskMode", "build_tree",
    "links_from_parents", "make_tree_mask", "organize_draft_results", "parents_from_links",
    "tensors_to_trees", "trees_to_tensors", "unpack_bits", "verify_tree_greedy",
]
