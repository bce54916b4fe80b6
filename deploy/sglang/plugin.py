"""The SGLang plugin: registers the `DRELAY` speculative algorithm (entry point group
`sglang.srt.plugins`, see pyproject.toml). Importable without SGLang: sglang is imported only
inside `register()`, which SGLang's `load_plugins()` calls once per process (server and every
TP worker; `SGLANG_PLUGINS=drelay` whitelists it).

What `register()` does (SGLang ≥ 0.5.23 seams, see docs/sglang.md):
  - `SpeculativeAlgorithm.register("DRELAY", supports_overlap=True, validate_server_args=…,
    spec_class=DRelaySpecAlgo)` with a factory `ServerArgs → worker class`. `DRelaySpecAlgo` answers
    `is_dflash_family()` (and `is_dflash()`) with True, so the scheduler and model runner take their
    DFLASH branches (target hidden-state capture, draft KV materialisation, V2 overlap schema).
  - the worker class subclasses SGLang's `DFlashWorkerV2`: drafting, verification, acceptance and
    the `sglext` statistics stay SGLang's; DRelay enters as the draft model's `candidate_selector`
    (seam.py), i.e. inside the captured draft graph, before verification.
The draft model class is registered separately by `SGLANG_EXTERNAL_MODEL_PACKAGE=deploy.sglang.models`.

Read in SGLang 0.5.23's source (wheel, not run): DFlashWorkerV2 calls
`draft_model.compute_candidates(hidden [N, D])` and `draft_model.candidate_selector.build_lattice /
sample_path` (`_selector_lattice`, `_SelectorDraftSampler`), and materialises target features
through `_append_target_hidden_to_draft_kv_by_loc(target_hidden [T, L·D], …, commit_lens |
extend_lens)`, which DRelayWorker extends to feed the ring; it also binds the exported selector
to the target's input embedding (`bind_selector`) before installing the seam. The draft model's
runner forward is runner.py's (RadixAttention over the paged draft KV). Not verified here (no GPU;
SGLang cannot serve on CPU): any of this inside an SGLang process; benchmarks/gpu/sglang_check.py
exercises it on the first GPU machine.
"""

from __future__ import annotations

ALGORITHM = "DRELAY"
BLOCK_SIZE = 16  # H = 15 slots + the anchor (the paper's setting)


def validate_server_args(server_args) -> None:
    """DRELAY needs a draft model path and a block of at least 2 tokens; one-line errors."""
    if not getattr(server_args, "speculative_draft_model_path", None):
        raise ValueError("--speculative-algorithm DRELAY needs --speculative-draft-model-path (a `drelay export --format sglang` directory)")
    n = getattr(server_args, "speculative_num_draft_tokens", None)
    if n is not None and int(n) < 2:
        raise ValueError(f"--speculative-num-draft-tokens must be ≥ 2 for DRELAY (got {n})")


def feed_ring(ring, slots, target_hidden, *, commit_lens=None, extend_lens=None) -> None:
    """Append one forward's verified target features [T, L·D] to the rows' rings.

    Decode/verify (`commit_lens` [bs]): rows are dense, block_size per request, and the first
    commit_lens[b] are verified. Prefill/extend (`extend_lens` [bs]): rows are packed; a new
    request's ring is reset first. (Outside the draft graph: the unpacking may sync.)
    """
    import torch

    bs = slots.shape[0]
    if commit_lens is not None:
        feats = target_hidden[: bs * (target_hidden.shape[0] // bs)].view(bs, -1, target_hidden.shape[-1])
        ring.append(slots, feats, commit_lens.to(torch.long))
        return
    lens = extend_lens.to(torch.long)
    width = int(lens.max())
    start = torch.cumsum(lens, 0) - lens  # [bs]
    idx = (start[:, None] + torch.arange(width, device=lens.device)).clamp(max=target_hidden.shape[0] - 1)
    ring.reset(slots)
    ring.append(slots, target_hidden[idx], lens)


def _spec_class():
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class DRelaySpecAlgo(CustomSpecAlgo):
        """DRELAY behaves as a DFLASH-family algorithm everywhere outside the worker."""

        def is_dflash(self) -> bool:
            return True

        def is_dflash_family(self) -> bool:
            return True

    return DRelaySpecAlgo


def _worker_class():
    import torch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    class DRelayWorker(DFlashWorkerV2):
        """DFLASH drafting and verification with DRelay's selector on the pool, fed by a
        per-request ring of verified target features."""

        def __init__(self, server_args, *args, **kwargs):
            from sglang.srt.runtime_context import get_exec, get_schedule

            super().__init__(server_args, *args, **kwargs)
            # The selector shares the target's input embedding (as in training).
            self.draft_model.bind_selector(self._target_worker.model_runner.model.get_input_embeddings().weight)
            seam = self.draft_model.selector_seam(
                max_requests=int(get_schedule().max_running_requests),
                max_bs=max(get_exec().graph.cuda_graph_config.decode.bs),
                device=self.device,
            )
            self.draft_model.candidate_selector = seam
            self.selector = seam

        def forward_batch_generation(self, batch, *args, **kwargs):
            # Stage the rows' request-pool slots before any draft graph replay reads the ring.
            self._drelay_slots = batch.req_pool_indices.to(torch.long)
            if self.selector is not None:
                self.selector.stage_requests(self._drelay_slots)
            return super().forward_batch_generation(batch, *args, **kwargs)

        def _append_target_hidden_to_draft_kv_by_loc(self, *, target_hidden, commit_lens=None, extend_lens=None, **kwargs):
            super()._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=target_hidden, commit_lens=commit_lens, extend_lens=extend_lens, **kwargs
            )
            ring = getattr(self.selector, "history", None)
            if ring is not None and target_hidden is not None and target_hidden.numel():
                feed_ring(ring, self._drelay_slots, target_hidden, commit_lens=commit_lens, extend_lens=extend_lens)

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
