"""The `drelay_selector/` folder of a vLLM export: the trained selector beside the DFlash drafter.

vLLM's stock loader reads every `*.safetensors` in the draft directory's root and refuses tensors
its DFlash model does not own, so the selector lives one level down, where vLLM never looks:

    <export>/drelay_selector/config.json        {"drafter": DrafterConfig.to_dict(),
                                                 "selector": {"name": …, "config": {…}}}
    <export>/drelay_selector/model.safetensors  the selector's tensors, named `selector.<param>`

The plugin (plugin.py) builds the selector from it inside vLLM's worker; without the folder vLLM
drafts natively. Pure PyTorch + safetensors: importable in either venv.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from drelay_model.drafter import DrafterConfig
from drelay_model.errors import DRelayError

SELECTOR_DIR = "drelay_selector"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class SavedSelector:
    """What the folder holds: the drafter's config (sizes the selector), the selector's saved
    name/config and its tensors (`selector.<param>`)."""

    drafter: DrafterConfig
    selector: dict
    tensors: dict[str, torch.Tensor]


def write_selector_dir(out: Path, drafter: DrafterConfig, selector: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `out/drelay_selector/` (inside an export being built in a temp dir)."""
    from safetensors.torch import save_file

    folder = Path(out) / SELECTOR_DIR
    folder.mkdir()
    own = {k: v.contiguous() for k, v in tensors.items() if k.startswith("selector.")}
    save_file(own, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps({"drafter": drafter.to_dict(), "selector": selector}, indent=2))
    for path in (folder, folder / WEIGHTS, folder / CONFIG):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def read_selector_dir(draft_dir: str | Path) -> SavedSelector | None:
    """The selector saved beside an exported drafter; None when the folder is absent."""
    from safetensors.torch import load_file

    folder = Path(draft_dir) / SELECTOR_DIR
    if not folder.is_dir():
        return None
    try:
        doc = json.loads((folder / CONFIG).read_text())
        drafter, selector = DrafterConfig.from_dict(doc["drafter"]), doc["selector"]
        name = selector["name"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DRelayError(f"'{folder}/{CONFIG}' is not a DRelay selector config ({type(exc).__name__}: {exc})") from exc
    if not isinstance(name, str) or not name:
        raise DRelayError(f"'{folder}/{CONFIG}': selector.name must be a selector's name")
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as exc:  # safetensors raises several types for a missing or corrupted file
        raise DRelayError(f"'{folder}/{WEIGHTS}' cannot be read ({exc})") from exc
    return SavedSelector(drafter=drafter, selector=selector, tensors=tensors)


def build_selector(saved: SavedSelector, embed_weight: torch.Tensor, *, dtype: torch.dtype):
    """The saved selector, sharing the target's input embedding [≥ V, D] (as in training), on
    that tensor's device, in `dtype` (the draft model's)."""
    from drelay_model.selectors import default_registry

    view = SimpleNamespace(config=saved.drafter, embed_weight=embed_weight)  # what selectors size themselves from
    with torch.device(embed_weight.device):
        selector = default_registry().from_checkpoint(
            saved.selector["name"], drafter=view, tensors=saved.tensors, meta={"selector": saved.selector}
        )
    return selector.to(device=embed_weight.device, dtype=dtype).eval()


def native_view(draft_dir: str | Path, out: str | Path) -> Path:
    """`out`: the export without its selector (symbolic links to everything else), which vLLM
    drafts natively even with the plugin loaded: the DFlash baseline beside DRelay."""
    draft_dir, out = Path(draft_dir).absolute(), Path(out)
    out.mkdir(parents=True)
    for path in draft_dir.iterdir():
        if path.name != SELECTOR_DIR:
            (out / path.name).symlink_to(path)
    return out
