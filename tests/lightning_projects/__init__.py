"""Three Lightning projects written as a user writes them, knowing nothing of disttrain: a conv-net image classifier,
an embedding-table recommender and a bf16 MLP regressor, each with its own datamodule (synthetic, generated from a
seed: nothing is downloaded). Plugged in with ``~model +model._target_=... ~data +data._target_=...``."""
