"""Trace replay and simulation: traces, drivers, bounds."""
