"""Hyperparameter sweeps on Optuna (``hydra/sweeper=optuna``): search space, study, screening, pruning."""
