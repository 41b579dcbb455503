"""Telemetry collection (``diagnostics.collect``) and pure-Python analysis of recorded runs."""
