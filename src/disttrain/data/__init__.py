"""Data sources and datamodules: synthetic Markov (known loss floor), byte-level text, uint16 token files."""
