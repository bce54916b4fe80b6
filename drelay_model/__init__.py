"""DRelay as a pure PyTorch library: target adapter, block drafter, selectors, decoding engine,
training math, diagnostics — the method itself, with no orchestration.

May import: torch, transformers, safetensors, gguf. Never pipelines, deploy, ray, mlflow or sglang
(tests/test_layering.py and tests/model/test_imports.py keep it so).
"""
