"""Telemetry collection inside a training run (the only part of ``diagnostics`` that imports torch)."""
