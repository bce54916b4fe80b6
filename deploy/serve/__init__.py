"""The OpenAI-compatible Ray Serve application, its backends, configs and load generator (docs/serving.md)."""
