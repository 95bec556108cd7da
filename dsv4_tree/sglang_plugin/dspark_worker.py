"""The DSpark worker under a DSpark tree: AROUND hooks on SGLang 0.5.23's `DSparkWorkerV2`.

* `__init__`: SGLang's constructor (its draft runner, proposer, injector and verify executor, sized
  by the tree's gamma and N through `dspark_runtime.py`), then, on the draft-hosting stage of a
  DSpark tree, the tree step (`dspark_step.DSparkTreeStep`), which refuses by name what it cannot
  serve.
* `_forward_decode`: the tree step when the worker has one; SGLang's chain step otherwise (topk 1
  is SGLang's code alone). Prefill stays SGLang's (it injects every prompt row's features)."""
from __future__ import annotations

STEP = "_dsv4_tree_step"


def around_dspark_worker_init(original, worker, *args, **kwargs):
    original(worker, *args, **kwargs)
    from .dspark_runtime import dspark_tree_spec

    tree = dspark_tree_spec()
    if tree is None or not worker.__dict__.get("_hosts_draft", False):
        return
    from .dspark_step import DSparkTreeStep

    worker.__dict__[STEP] = DSparkTreeStep(worker, tree)


def around_dspark_forward_decode(original, worker, batch, on_publish, grammar_barrier=None, coordination_plan=None):
    step = worker.__dict__.get(STEP)
    if step is None:
        return original(worker, batch, on_publish, grammar_barrier, coordination_plan)
    return step.run(batch, on_publish, grammar_barrier, coordination_plan)
