"""Drafter (and selector) training on Ray Train: data, the worker loop, the driver."""
