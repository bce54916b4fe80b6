"""vLLM as a second engine for our drafters: the DFlash export (`export.py`) and the runner that
drives vLLM in its own venv (`make vllm-env`)."""
