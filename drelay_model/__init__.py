"""DRelay as a pure PyTorch library: target adapter, block drafter, selectors, decoding engine.

Never imports ray, mlflow or sglang (tests/model/test_imports.py keeps it so).
"""
