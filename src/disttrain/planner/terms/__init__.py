"""Each strategy's planner terms, one module per strategy; importing a module registers its ``StrategyTerms``.

The order of the imports is the order strategies appear in (``spec.planned_strategies``, the unknown-strategy
message). A new strategy is a new module here and one line below (docs/extension.md).
"""

# isort: off
from disttrain.planner.terms import ddp  # noqa: F401  (each import registers the module's terms)
from disttrain.planner.terms import fsdp  # noqa: F401
from disttrain.planner.terms import deepspeed  # noqa: F401
from disttrain.planner.terms import megatron  # noqa: F401
# isort: on
