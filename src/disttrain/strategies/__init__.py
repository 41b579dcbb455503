"""One module per strategy and one ``StrategySpec`` each (``<name>_spec.py``, the interface in spec.py, found by
``registry.spec_of``): validation, layout, planner view and builders.

Kept free of imports so that the specs load without torch or Lightning.
"""
