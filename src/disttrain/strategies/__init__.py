"""One module per strategy, one ``StrategySpec`` each (spec.py): validation, layout, planner view and builders.

Kept free of imports so that ``disttrain.strategies.spec`` loads without torch or Lightning.
"""
