"""``python -m tune``: diagnose a run, A/B its best math-preserving lever, keep what is confirmed, repeat.

``levers`` says which overrides keep the training math, ``rules`` holds the decisions (candidates, keep, stop,
budget), ``losses`` reads the loss curves the keep rule compares, ``loop`` drives rounds with the existing
interleaved A/B (``diagnostics.ab``), ``summary`` writes the live table, ``tune/summary.{md,json}`` and the
experiment file of the final config.
"""
