"""The engine's device tables (`serving/tables.py`) and the SGLang plug-in's tree tables
(`sglang_plugin/tables.py`, `serving/swa_table.py`) are one implementation: the plug-in's
functions call the engine's table functions themselves (ancestor doubling, the path-slot rule of
SWA windows and compressor sources, branch entries, committed-then-branch entry lists), not
copies of them. The plug-in's tables import no SGLang, so this runs in the main suite."""
import inspect

import torch

from dsv4_tree.serving import swa_table
from dsv4_tree.serving import tables as engine
from dsv4_tree.sglang_plugin import tables as plugin

SHARED = ("ancestors", "path_slots", "branch_entries", "append_branch")


def test_the_plugin_tables_are_the_engine_functions():
    assert plugin.packed_ancestors is engine.ancestors
    assert plugin.branch_entries is engine.branch_entries
    assert plugin.append_branch is engine.append_branch
    assert swa_table.ancestors is engine.ancestors
    assert swa_table.path_slots is engine.path_slots
    assert plugin.tree_swa_page_indices is swa_table.tree_swa_page_indices


def test_no_second_copy_of_the_shared_rules():
    """No module of the pair defines its own version of a shared function."""
    for module in (plugin, swa_table):
        own = {name for name, f in inspect.getmembers(module, inspect.isfunction) if f.__module__ == module.__name__}
        assert not own & set(SHARED), (module.__name__, own & set(SHARED))


def test_plugin_rows_follow_the_engine_rule_on_a_small_tree():
    """The plug-in's branch entries of a tree are the engine's `branch_entries` on packed rows:
    the same slots for the rows that close blocks on their path, -1 elsewhere."""
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    seq_lens = torch.tensor([6])  # P = 6: positions 6.. close C4 blocks at 7, 11
    out = torch.arange(100, 106)
    branch, count = plugin.tree_branch_entries(out, parents, seq_lens, 4)
    # depth 0: 6, depth 1: 7 (closes, written by node 1 or 2), depth 2: 8, depth 3: 9
    assert count.tolist() == [0, 1, 1, 1, 1, 1]
    assert branch[:, 0].tolist() == [-1, 101, 102, 101, 102, 101]
