"""The indexer top-k tie rule's one constant (design_notes/indexer-tie-rule.md): exact ties
at the top-k boundary go to the earlier block; a boundary gap within this relative margin is
reported as a (near-)tie. The torch backend, the Triton indexer and the reference all read it
from here."""

TIE_MARGIN = 1e-4  # relative score gap at the top-k boundary reported as a (near-)tie
