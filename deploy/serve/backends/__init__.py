"""Serve backends: `engine` (this project's engine) and `sglang` (an SGLang server with DRelay)."""
