"""Serving: Ray Serve application and engine backends (reference PyTorch engine, SGLang)."""
