"""Trained selector heads beside a checkpoint's own: `<checkpoint>/heads/<selector>.safetensors`.

A drafter checkpoint holds its drafter and the selector it was trained with (`selector.*` tensors,
`meta["selector"]`). Heads trained later on the same frozen drafter (the selector stage trains one
head at a time and exports the drafter bit for bit as it came in) ride along in `heads/`: one file
per selector, holding that head's `selector.*` tensors, with the head's `{"name", "config"}`, where
it came from and the digest of the drafter it was trained on in the file's metadata. `--method NAME`
then decodes with that head wherever the checkpoint's own selector is another (`read_head`).

The digest covers the drafter's config and every tensor of the checkpoint except `selector.*`, so a
head never serves a drafter other than its own: a drafter retrained since is a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from drelay_model.drafter.checkpoint import read_checkpoint
from drelay_model.errors import DRelayError

HEADS = "heads"
SELECTOR_PREFIX = "selector."


def drafter_digest(config_dict: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha1 of the drafter config and every non-selector tensor (names, dtypes, shapes, bytes)."""
    h = hashlib.sha1(json.dumps(config_dict, sort_keys=True).encode())
    for name in sorted(k for k in tensors if not k.startswith(SELECTOR_PREFIX)):
        t = tensors[name].contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def head_path(checkpoint: str | Path, name: str) -> Path:
    return Path(checkpoint) / HEADS / f"{name}.safetensors"


def head_names(checkpoint: str | Path) -> list[str]:
    """The selectors with a head file under `<checkpoint>/heads/`."""
    folder = Path(checkpoint) / HEADS
    return sorted(p.stem for p in folder.glob("*.safetensors")) if folder.is_dir() else []


def add_head(source: str | Path, checkpoint: str | Path) -> tuple[str, Path]:
    """Copy the trained selector of checkpoint `source` into `<checkpoint>/heads/<name>.safetensors`.
    `source` must hold the same drafter bit for bit (e.g. a selector-stage run's export of it) and a
    trained selector other than `checkpoint`'s own. Written to a temp file, then renamed. → (name, path)."""
    from safetensors.torch import save_file

    src_cfg, src_tensors, src_meta = read_checkpoint(source)
    dst_cfg, dst_tensors, dst_meta = read_checkpoint(checkpoint)
    selector = src_meta.get("selector") or {}
    name = selector.get("name")
    head = {k: v for k, v in src_tensors.items() if k.startswith(SELECTOR_PREFIX)}
    if not name or name in ("native", "none") or not head:
        raise DRelayError(f"'{source}' holds no trained selector head (meta selector: {name or 'none'})")
    if name == (dst_meta.get("selector") or {}).get("name"):
        raise DRelayError(f"'{checkpoint}' already holds a trained '{name}' selector of its own")
    digest = drafter_digest(dst_cfg.to_dict(), dst_tensors)
    if drafter_digest(src_cfg.to_dict(), src_tensors) != digest:
        raise DRelayError(f"'{source}' was trained on another drafter than '{checkpoint}' (their drafter tensors differ)")
    meta = {"selector": json.dumps(selector), "drafter_digest": digest,
            "source": json.dumps({k: src_meta.get(k) for k in ("run_name", "step") if k in src_meta})}  # fmt: skip
    out = head_path(checkpoint, name)
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file({k: v.contiguous() for k, v in head.items()}, str(tmp), metadata=meta)
    umask = os.umask(0)  # safetensors writes 0600; a head file is read by whoever reads the checkpoint
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, out)
    return name, out


def read_head(checkpoint: str | Path, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The head `name` of `checkpoint` as (tensors named `selector.*`, meta with "selector"), checked
    against the checkpoint's drafter. One-line DRelayError when it is missing, corrupted or stale."""
    from safetensors import SafetensorError, safe_open

    path = head_path(checkpoint, name)
    if not path.is_file():
        raise DRelayError(f"the checkpoint holds no trained '{name}' selector (add one with `drelay heads add`)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        selector = json.loads(meta["selector"])
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise DRelayError(f"head '{path}' is corrupted ({type(exc).__name__}: {exc})") from exc
    cfg, own, _ = read_checkpoint(checkpoint)
    if meta.get("drafter_digest") != drafter_digest(cfg.to_dict(), own):
        raise DRelayError(
            f"head '{path}' was trained on another drafter than the checkpoint's (digests differ): retrain or re-add it"
        )
    if selector.get("name") != name:
        raise DRelayError(f"head '{path}' holds a '{selector.get('name')}' selector, not '{name}'")
    return tensors, {"selector": selector, "head_source": json.loads(meta.get("source") or "{}")}


def carry_heads(old: str | Path, new: str | Path) -> list[str]:
    """Copy the heads of checkpoint `old` that fit checkpoint `new`'s drafter (same digest) and that
    `new` does not hold as its own selector into `new/heads/`; → the names carried. A checkpoint
    replaced by one of the same drafter (a newly shipped head) keeps its other heads this way."""
    import shutil

    names = head_names(old)
    if not names:
        return []
    cfg, tensors, meta = read_checkpoint(new)
    digest, own = drafter_digest(cfg.to_dict(), tensors), (meta.get("selector") or {}).get("name")
    carried = []
    for name in names:
        try:
            stale = _metadata(head_path(old, name)).get("drafter_digest") != digest
        except DRelayError:
            stale = True
        if stale or name == own:
            continue
        (Path(new) / HEADS).mkdir(exist_ok=True)
        shutil.copyfile(head_path(old, name), head_path(new, name))
        carried.append(name)
    return carried


def _metadata(path: Path) -> dict:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise DRelayError(f"head '{path}' is corrupted ({exc})") from exc
