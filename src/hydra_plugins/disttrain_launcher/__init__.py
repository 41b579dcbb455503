"""disttrain's Hydra launcher plugin (``hydra/launcher=slurm``); see ``slurm_launcher``."""
