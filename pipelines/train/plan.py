"""`drelay plan --config <train.yaml> [--gpu-memory 80]`: per-GPU peak memory and FLOPs of a run.

The estimate comes from shapes alone (drelay_model.training.memory_plan; no weights are loaded):
the target's architecture (known Qwen3 / SmolLM2 shapes, a local model directory's config.json,
or a tiny test spec), the drafter and selector sections, and the per-worker step (seqs_per_step,
max_seq_len, anchors_per_seq, micro_batches, chunk_tokens, bf16), and DDP's gradient buckets when
more than one worker trains with `ray.strategy: ddp`. Attention is priced on the path
the code takes on the planned device (`planned_device`: CUDA for a GPU run, else CPU; see
drelay_model/attention.py), and the report names it. A plan that does not fit is a one-line error
(exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from drelay_model.attention import attention_path
from drelay_model.errors import DRelayError
from drelay_model.training import memory_plan as mp
from pipelines.train.config import RunConfig

# Published architectures (config.json of each model), so planning needs no download.
KNOWN_TARGETS = {
    "Qwen/Qwen3-4B": dict(
        vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, tied_embeddings=True
    ),
    "Qwen/Qwen3-8B": dict(
        vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, tied_embeddings=False
    ),
    "smollm2-135m": dict(
        vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, tied_embeddings=True
    ),
}


@dataclass
class PlanReport:
    config: str
    plan: mp.MemoryPlan
    gpu_memory_gib: float
    selector_params: int
    drafter_params: int
    device: str = "cuda"
    shapes: tuple = ()  # (TargetShape, DrafterShape, SelectorShape | None, StepShape): re-estimate on another path
    ddp: bool = False  # DDP's gradient buckets are in the plan
    cache_bytes: int | None = None  # the selector stage's block cache, at most (None: not a selector stage)
    cache_sequences: int = 0
    workers: int = 1

    @property
    def fits(self) -> bool:
        return self.plan.total <= self.gpu_memory_gib * mp.GiB


def target_shape(spec: str, dtype: str) -> mp.TargetShape:
    bytes_per_param = 2 if dtype == "bfloat16" else 4
    if spec in KNOWN_TARGETS:
        return mp.TargetShape(**KNOWN_TARGETS[spec], bytes_per_param=bytes_per_param)
    path = Path(spec).expanduser() / "config.json"
    if path.is_file():
        c = json.loads(path.read_text())
        return mp.TargetShape(
            vocab=c["vocab_size"],
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=c["num_attention_heads"],
            kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            intermediate=c["intermediate_size"],
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            bytes_per_param=bytes_per_param,
        )
    if spec.split(":")[0] in ("tiny-llama", "tiny-qwen3"):
        from drelay_model.target import load_target

        t = load_target(spec)
        return mp.TargetShape(
            t.vocab_size,
            t.hidden_size,
            t.num_layers,
            t.n_heads,
            t.n_kv_heads,
            t.head_dim,
            t.config.intermediate_size,
            bool(t.config.tie_word_embeddings),
            bytes_per_param,
        )
    raise DRelayError(
        f"target.spec: cannot plan for '{spec}' without its config.json (known: {', '.join(KNOWN_TARGETS)}, a local model directory, tiny-*)"
    )


def planned_device(cfg: RunConfig) -> str:
    """The device type a run's workers train on: CUDA with ray.use_gpu unless target.device is cpu
    (as `pipelines.train.worker.worker_device` decides)."""
    return "cpu" if cfg.target.device == "cpu" or not cfg.ray.use_gpu else "cuda"


def predicted_peak_bytes(cfg: RunConfig, device: str | None = None) -> int:
    """Predicted peak memory per GPU (bytes) of a run config on `device` (default: its planned one)."""
    return plan_from_config(cfg, device=device).plan.total


def plan_from_config(
    cfg: RunConfig, gpu_memory_gib: float = 80.0, *, config_name: str = "", device: str | None = None
) -> PlanReport:
    """The memory plan of `cfg` on `device` ("cpu" / "cuda"; default: `planned_device(cfg)`)."""
    if not 0 < gpu_memory_gib <= 4096:
        raise DRelayError(f"--gpu-memory must be in (0, 4096] GiB, got {gpu_memory_gib}")
    t = target_shape(cfg.target.spec, cfg.target.dtype)
    dr = cfg.drafter
    L = t.layers
    layer_ids = dr.target_layer_ids or tuple(sorted({min(1, L - 1), L // 2, max(L - 2, 0)}))
    d = mp.DrafterShape(
        layers=dr.num_layers,
        hidden=t.hidden,
        heads=t.heads,
        kv_heads=t.kv_heads,
        head_dim=t.head_dim,
        intermediate=dr.intermediate_size or t.intermediate,
        feature_layers=len(layer_ids),
        block_size=dr.block_size,
        top_k=dr.top_k,
        draft_vocab=dr.draft_vocab_size,
    )
    s = None
    if cfg.selector.trains_selector:
        from drelay_model.selectors.drelay.config import DRelayConfig

        sc = DRelayConfig.from_dict(cfg.selector.config)
        n = mp.count_selector_params(cfg.selector.name, cfg.selector.config, drafter_shape=d, target=t)
        s = mp.SelectorShape(
            params=n, d=sc.d_sel, heads=sc.heads, read_dim=sc.read_dim, compact_dim=sc.compact_dim, history_len=sc.history_len
        )
    tr = cfg.train
    st = mp.StepShape(tr.seqs_per_step, cfg.data.max_seq_len, tr.anchors_per_seq, tr.micro_batches, tr.chunk_tokens, tr.bf16)
    device = device or planned_device(cfg)
    if device not in ("cpu", "cuda"):
        raise DRelayError(f"--device must be cpu or cuda, got '{device}'")
    ddp = cfg.ray.num_workers > 1 and cfg.ray.strategy == "ddp"  # as pipelines.train.worker wraps the module
    plan = mp.estimate(t, d, s, st, attention=attention_path(device), ddp=ddp, frozen_drafter=cfg.drafter.freeze)
    report = PlanReport(config_name, plan, gpu_memory_gib, s.params if s else 0, d.params(), device, (t, d, s, st), ddp)
    if tr.stage == "selector":
        report.cache_sequences, report.workers = cfg.data.block_cache_sequences or 0, cfg.ray.num_workers
        report.cache_bytes = block_cache_bytes(cfg, t.hidden, len(layer_ids))
    return report


def block_cache_bytes(cfg: RunConfig, hidden: int, feature_layers: int) -> int | None:
    """Upper bound of the selector stage's block cache (pipelines/train/block_cache.py): per block
    hidden H·D bf16 + pool H·K (int32 ids, fp32 log q) + labels H int32 + valid H + 20 B of anchors;
    per cached token F = L·D bf16 features; every sequence at data.max_seq_len, anchors_per_seq
    blocks each. None when the cache holds every training sequence (unknown count)."""
    n = cfg.data.block_cache_sequences
    if n is None:
        return None
    H, K, M = cfg.drafter.block_size - 1, cfg.drafter.top_k, cfg.train.anchors_per_seq
    per_block = H * hidden * 2 + H * K * 8 + H * 5 + 20
    return n * (M * per_block + cfg.data.max_seq_len * feature_layers * hidden * 2)


def format_report(r: PlanReport) -> str:
    head = (
        f"plan for {r.config or 'config'} on {r.device}: per GPU; drafter {r.drafter_params / 1e6:.1f}M params, "
        f"selector {r.selector_params / 1e6:.1f}M params"
    )
    text = head + "\n" + mp.format_plan(r.plan, r.gpu_memory_gib)
    if r.cache_bytes is not None:
        text += (
            f"\nselector stage: block cache ≤ {r.cache_bytes / mp.GiB:.1f} GiB on disk ({r.cache_sequences} sequences), "
            f"each of the {r.workers} workers holding its share in host memory; the target and drafter rows above "
            "are the cache build's (once), the training steps run the head alone"
        )
    return text


def check_fits(r: PlanReport) -> None:
    """A one-line DRelayError when the plan exceeds the GPU's memory."""
    if not r.fits:
        raise DRelayError(
            f"the plan needs {r.plan.total / mp.GiB:.1f} GiB per GPU, more than {r.gpu_memory_gib:g} GiB "
            "(raise train.micro_batches, lower train.anchors_per_seq or train.chunk_tokens)"
        )
