"""The SGLang plugin: registers the `DRELAY` speculative algorithm (entry point group
`sglang.srt.plugins`, see pyproject.toml). Importable without SGLang: sglang is imported only
inside `register()`, which SGLang's `load_plugins()` calls once per process (server and every
TP worker; `SGLANG_PLUGINS=drelay` whitelists it).

What `register()` does (SGLang ≥ 0.5.23 seams, see docs/sglang.md):
  - `SpeculativeAlgorithm.register("DRELAY", supports_overlap=True, validate_server_args=…,
    spec_class=DRelaySpecAlgo)` with a factory `ServerArgs → worker class`. `DRelaySpecAlgo` answers
    every question SGLang asks of an algorithm as DFLASH does (`is_dflash*`, `supports_*`,
    `need_topk`, `carries_draft_hidden_states`, `handle_server_args`, …), so the scheduler, overlap
    utilities, model runner and argument handling take DFLASH's paths and derive DFLASH's fields
    (speculative_num_steps = topk = 1, the draft attention backend, max_running_requests 48).
  - the worker class subclasses SGLang's `DFlashWorkerV2`: drafting, verification, acceptance and
    the `sglext` statistics stay SGLang's; DRelay enters as the draft model's `candidate_selector`
    (seam.py), i.e. inside the captured draft graph, before verification.
The draft model class is registered separately by `SGLANG_EXTERNAL_MODEL_PACKAGE=deploy.sglang.models`.

Checked against SGLang 0.5.23's modules on CPU (`make test-sglang`): plugin loading, registration,
argument handling, the spec-class answers, the request pool's slot range. Read in its source (needs
a GPU to run): DFlashWorkerV2 calls
`draft_model.compute_candidates(hidden [N, D])` and `draft_model.candidate_selector.build_lattice /
sample_path` (`_selector_lattice`, `_SelectorDraftSampler`), and materialises target features
through `_append_target_hidden_to_draft_kv_by_loc(target_hidden [T, L·D], …, commit_lens |
extend_lens)`, which DRelayWorker extends to feed the ring (ring_feed.py); it also binds the exported selector
to the target's input embedding (`bind_selector`) before installing the seam. The draft model's
runner forward is runner.py's (RadixAttention over the paged draft KV); benchmarks/gpu/sglang_check.py
runs the server on a GPU machine.
"""

from __future__ import annotations

ALGORITHM = "DRELAY"
BLOCK_SIZE = 16  # H = 15 slots + the anchor (the paper's setting)


def validate_server_args(server_args) -> None:
    """DRELAY needs a draft model path and a block of at least 2 tokens; its draft runs
    unquantized. One-line errors.

    Quantization: SGLang gives the draft the target's `--quantization` unless
    `--speculative-draft-model-quantization` says otherwise. A DRELAY export is plain bf16/fp16/fp32
    weights, so a quantized target is served with an unquantized draft (the draft quantization is
    cleared here, before any ModelConfig is built); asking for a quantized draft explicitly is refused."""
    if not getattr(server_args, "speculative_draft_model_path", None):
        raise ValueError(
            "--speculative-algorithm DRELAY needs --speculative-draft-model-path (a `drelay export --format sglang` directory)"
        )
    n = getattr(server_args, "speculative_num_draft_tokens", None)
    if n is not None and int(n) < 2:
        raise ValueError(f"--speculative-num-draft-tokens must be ≥ 2 for DRELAY (got {n})")
    quant = getattr(server_args, "speculative_draft_model_quantization", None)
    if quant not in (None, "unquant"):
        if getattr(server_args, "_speculative_draft_quantization_explicitly_set", False):
            raise ValueError(
                f"--speculative-draft-model-quantization {quant}: DRELAY drafts run unquantized (omit it or pass 'unquant')"
            )
        server_args.speculative_draft_model_quantization = None  # the target keeps --quantization
    _check_draft_config(server_args)


def _check_draft_config(server_args) -> None:
    """A local draft directory must be a DRELAY export carrying the served context length (SGLang
    would refuse it later, in the scheduler); logs what it found. Hub ids are left to SGLang."""
    import json
    import logging
    from pathlib import Path

    path = Path(server_args.speculative_draft_model_path)
    try:
        doc = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return
    if "DRelayDraftModel" not in (doc.get("architectures") or []):
        raise ValueError(
            f"--speculative-draft-model-path {path}: architectures {doc.get('architectures')} are not a DRELAY export "
            "(make one with `drelay export --format sglang`)"
        )
    have, want = doc.get("max_position_embeddings"), getattr(server_args, "context_length", None)
    if want and (not have or int(have) < int(want)):
        raise ValueError(
            f"--speculative-draft-model-path {path}: the export carries context length {have}, below --context-length "
            f"{want}; re-export with `drelay export --format sglang --context-length {want}`"
        )
    dflash = doc.get("dflash_config") or {}
    logging.getLogger(__name__).info(
        "DRELAY draft %s: block %s, target layers %s, context length %s, selector %s",
        path, dflash.get("block_size"), dflash.get("target_layer_ids"), have, (doc.get("drelay_selector") or {}).get("name"),
    )  # fmt: skip


# SpeculativeAlgorithm members that are not questions about the algorithm (class-level API) or
# that DRELAY answers itself: its worker (create_worker, get_platform_worker_cls) and the overlap
# future map, which must hold DRELAY's spec object (create_future_map).
_NOT_DELEGATED = frozenset({"register", "from_string", "create_worker", "get_platform_worker_cls", "create_future_map"})


def _spec_class():
    """`DRelaySpecAlgo`: every question SGLang asks of a speculative algorithm (`is_*`,
    `supports_*`, `has_draft_kv`, `carries_draft_hidden_states`, `need_topk`,
    `handle_server_args`, …) is answered by DFLASH's own enum member, so the scheduler, overlap
    utilities, model runner and argument handling take DFLASH's paths (target hidden-state capture,
    draft KV materialisation, V2 overlap schema, DFLASH's derived server args). The method set is
    read from `SpeculativeAlgorithm` itself, so predicates SGLang adds later answer as DFLASH too."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    dflash = SpeculativeAlgorithm.DFLASH

    class DRelaySpecAlgo(CustomSpecAlgo):
        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False):
            """The overlap scheduler's FutureMap, holding DRELAY (it asks the predicates above)."""
            return SpeculativeAlgorithm.create_future_map(
                self, device, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
            )

        def get_platform_worker_cls(self):
            """None: DRELAY always runs its own worker (no platform ships a DRELAY worker)."""
            return None

    def as_dflash(name: str):
        def answer(self, *args, **kwargs):
            return getattr(dflash, name)(*args, **kwargs)

        answer.__name__ = answer.__qualname__ = name
        answer.__doc__ = f"DFLASH's answer to `{name}`."
        return answer

    for name, member in vars(SpeculativeAlgorithm).items():
        if callable(member) and not name.startswith("_") and name not in _NOT_DELEGATED and name.isidentifier():
            if name not in SpeculativeAlgorithm.__members__:
                setattr(DRelaySpecAlgo, name, as_dflash(name))
    return DRelaySpecAlgo


def request_pool_rows(req_to_token_pool) -> int:
    """Rows of SGLang's request pool, i.e. the largest `req_pool_idx` + 1: slots run 1..size (row 0
    is padding for CUDA-graph batches) plus any pre-allocated rows. The verified-feature ring and
    the seam's slot buffer get one row per pool row, so every slot and every batch (prefill and
    eager ones included, which can exceed the largest captured batch) fits."""
    return int(req_to_token_pool.req_to_token.shape[0])


def install_selector_seam(draft_model, req_to_token_pool, *, device):
    """Build the draft model's `candidate_selector` (seam.py) for a request pool, once the pool
    exists; returns it (None when the export holds no selector)."""
    rows = request_pool_rows(req_to_token_pool)
    seam = draft_model.selector_seam(max_requests=rows, max_bs=rows, device=device)
    draft_model.candidate_selector = seam
    return seam


def _worker_class():
    import torch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from deploy.sglang.ring_feed import PrefillTracker, feed_prefill, feed_verify, plan_prefill

    class DRelayWorker(DFlashWorkerV2):
        """DFLASH drafting and verification with DRelay's selector on the pool, fed by a
        per-request ring of verified target features. SGLang builds the worker before the memory
        pools, so the seam (whose ring has one row per request-pool row) is installed in
        `alloc_memory_pool`, which runs before `init_cuda_graphs` captures the draft graph."""

        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            # The selector shares the target's input embedding (as in training).
            self.draft_model.bind_selector(self._target_worker.model_runner.model.get_input_embeddings().weight)
            self._drelay_tracker = PrefillTracker()
            self._drelay_feed = None

        def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
            super().alloc_memory_pool(
                memory_pool_config=memory_pool_config,
                req_to_token_pool=req_to_token_pool,
                token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            )
            # The target's pool: its slots are the batches' req_pool_indices.
            self.selector = install_selector_seam(self.draft_model, self.model_runner.req_to_token_pool, device=self.device)

        def forward_batch_generation(self, batch, *args, **kwargs):
            self.stage_batch(batch)
            return super().forward_batch_generation(batch, *args, **kwargs)

        def stage_batch(self, batch) -> None:
            """Host side, before any draft graph replay reads the ring: the rows' request-pool
            slots, and for a prefill the rows it commits (`ring_feed.plan_prefill`)."""
            self._drelay_slots = batch.req_pool_indices.to(torch.long)
            if self.selector is not None:
                self.selector.stage_requests(self._drelay_slots)
            self._drelay_feed = None
            if getattr(self.selector, "history", None) is None or batch.forward_mode.is_idle():
                return
            slots = [r.kv.req_pool_idx for r in batch.reqs]
            if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
                rids = [r.rid for r in batch.reqs]
                fresh = self._drelay_tracker.fresh_rows(slots, rids, batch.prefix_lens, batch.extend_lens)
                self._drelay_feed = plan_prefill(batch.extend_lens, fresh, size=self.selector.history.size, device=self.device)
            else:
                self._drelay_tracker.decoded(slots)

        def _append_target_hidden_to_draft_kv_by_loc(self, *, target_hidden, commit_lens=None, extend_lens=None, **kwargs):
            super()._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=target_hidden, commit_lens=commit_lens, extend_lens=extend_lens, **kwargs
            )
            ring = getattr(self.selector, "history", None)
            if ring is None or target_hidden is None or not target_hidden.numel():
                return
            if commit_lens is not None:
                feed_verify(ring, self._drelay_slots, target_hidden[: kwargs["cache_loc"].numel()], commit_lens)
            elif self._drelay_feed is not None:
                feed_prefill(ring, self._drelay_slots, target_hidden, self._drelay_feed)

    return DRelayWorker


def register() -> None:
    """The `sglang.srt.plugins` entry point: register DRELAY (idempotent within a process)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        SpeculativeAlgorithm.from_string(ALGORITHM)
        return  # already registered in this process
    except ValueError:
        pass

    @SpeculativeAlgorithm.register(
        ALGORITHM, supports_overlap=True, validate_server_args=validate_server_args, spec_class=_spec_class()
    )
    def _factory(server_args):
        return _worker_class()
