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

Not verified here (no GPU, SGLang cannot serve on CPU): that DFlashWorkerV2 drives an external draft
model through `candidate_selector` exactly as it drives DFlash-2's, and where the worker must
append each round's committed target features to the ring (`stage_requests` + `RequestFeatureRing`).
benchmarks/gpu/sglang_check.py exercises both on the first GPU machine.
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
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    class DRelayWorker(DFlashWorkerV2):
        """DFLASH drafting and verification with DRelay's selector on the pool."""

        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            seam = self.draft_model.selector_seam(
                max_requests=int(server_args.max_running_requests or 256),
                max_bs=int(server_args.cuda_graph_max_bs or 256),
                device=self.device,
            )
            self.draft_model.candidate_selector = seam
            self.selector = seam

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
