"""Verify budgets: how many draft nodes a verify step checks, for the whole batch
(design_notes/verify-budget.md).

`verify_budget` the batch pick (pure functions of tensors), `budget_policy` one drafter's budget
across rounds, `cost_table` / `cost_profile` the price of a step by rows, `node_values` /
`value_events` a DSpark tree node's value and its learning from accept events, `sibling_rate` a
drawn tree's sibling acceptance. The drafters feed them (drafters/dspark_budget.py)."""
