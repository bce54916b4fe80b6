"""The vLLM plugin: DRelay's selector chooses the drafts in vLLM's own V1 DFlash proposer.

Entry point `vllm.general_plugins: drelay = deploy.vllm.plugin:register` (pyproject.toml). vLLM
calls `register()` once per process (front end, engine core, every worker) before any model runner
exists; `VLLM_PLUGINS=drelay` whitelists it (unset: vLLM loads every installed plugin). It imports
vLLM inside `register()` only, so this module imports anywhere.

`register()` wraps four methods of `vllm.v1.spec_decode.dflash.DFlashProposer` (V1 model runner:
vLLM-CPU, and GPUs with `VLLM_USE_V2_MODEL_RUNNER=0`):
  - `__init__(vllm_config, device, runner)` keeps the runner (request ids live in its input batch);
  - `load_model(target_model)`: when the draft directory holds `drelay_selector/` (selector_dir.py)
    it builds the selector on the target's embedding and a `DraftChoice` (draft_choice.py) with a
    ring row per schedulable request (`max_num_seqs`); otherwise nothing changes;
  - `propose(...)` stages the step for the choice: the raw target features `target_hidden_states`
    [T, L·D] (before `combine_hidden_states` projects them), `query_start_loc`,
    `num_rejected_tokens_gpu`, `target_positions`, the anchors `next_token_ids` and
    `runner.input_batch.req_ids`;
  - `_sample_draft_tokens(hidden, sampling_metadata)` returns the selector's path and no draft
    probabilities: vLLM then verifies each draft as a point mass (accept x with probability p(x),
    else resample from p with x removed), the speculative-sampling rule for a deterministic draft.
    Greedy output is the target's token for token (tested); at T > 0 vLLM-CPU 0.32's own
    verification does not resample from the target's distribution, with or without this plugin
    (measured, docs/vllm.md).
A vLLM whose methods no longer have these signatures gets one warning and native drafting; so does
a step the choice cannot take (another number of drafts than the selector's H, a heterogeneous
vocabulary, a vocabulary-sharded argmax).
Two variables for measurement: DRELAY_VLLM_RECORD=DIR saves every step's selector inputs and path
(the replay tests, and the select profile on vLLM's own steps); DRELAY_VLLM_PROFILE=FILE appends one
JSON line per step with the choice's wall ms by part (benchmarks/profile_vllm_plugin.py).
"""

from __future__ import annotations

import inspect
import logging
import os

logger = logging.getLogger("vllm.plugins.drelay")  # under vLLM's logger: its handlers print it

# Method → parameters it must have (names as vLLM 0.32 spells them).
EXPECTED = {
    "__init__": ("vllm_config", "device", "runner"),
    "load_model": ("target_model",),
    "propose": ("target_positions", "target_hidden_states", "next_token_ids", "common_attn_metadata",
                "num_rejected_tokens_gpu"),
    "_sample_draft_tokens": ("hidden_states", "sampling_metadata"),
}  # fmt: skip
RECORD_ENV = "DRELAY_VLLM_RECORD"  # a directory: every step's pool and path are saved there (tests)
PROFILE_ENV = "DRELAY_VLLM_PROFILE"  # a file: one JSON line of the choice's wall ms by part per step
_warned: set[str] = set()


def warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("DRelay plugin: " + message, *args)


def signature_mismatch(cls) -> str | None:
    """Which wrapped method of `cls` lacks an expected parameter (a description), or None."""
    for name, params in EXPECTED.items():
        fn = getattr(cls, name, None)
        if fn is None:
            return f"{cls.__name__}.{name} is missing"
        have = inspect.signature(fn).parameters
        lost = [p for p in params if p not in have]
        if lost:
            return f"{cls.__name__}.{name} has no parameter {', '.join(lost)}"
    return None


def register() -> None:
    """The `vllm.general_plugins` entry point (idempotent within a process)."""
    try:
        from vllm.v1.spec_decode.dflash import DFlashProposer
    except ImportError as exc:
        warn_once("import", "vLLM's V1 DFlash proposer is not importable (%s); drafting stays native", exc)
        return
    if getattr(DFlashProposer, "_drelay_wrapped", False):
        return
    why = signature_mismatch(DFlashProposer)
    if why:
        warn_once("signature", "%s (an unknown vLLM); drafting stays native", why)
        return
    _wrap(DFlashProposer)
    DFlashProposer._drelay_wrapped = True


def _wrap(cls) -> None:
    init, load_model, propose, sample = cls.__init__, cls.load_model, cls.propose, cls._sample_draft_tokens
    propose_sig = inspect.signature(propose)

    def __init__(self, vllm_config, device, runner=None, *args, **kwargs):
        init(self, vllm_config, device, runner, *args, **kwargs)
        self._drelay_runner, self._drelay_choice = runner, None

    def _load_model(self, target_model, *args, **kwargs):
        load_model(self, target_model, *args, **kwargs)
        self._drelay_choice = build_choice(self, target_model)
        if self._drelay_choice is not None:
            self._drelay_logits = draft_vocab_logits(self.model)
            if self._drelay_logits[1] is not None:
                logger.info("DRelay plugin: the pool reads the draft vocabulary's %d logits", self._drelay_logits[1].shape[0])

    def _propose(self, *args, **kwargs):
        choice = getattr(self, "_drelay_choice", None)
        if choice is not None:
            try:
                stage(self, choice, propose_sig.bind(self, *args, **kwargs).arguments)
            except Exception as exc:  # a step the choice cannot read: native drafts, never a crash
                choice.staged = None
                warn_once("stage", "cannot read this step (%s: %s); native drafts for such steps", type(exc).__name__, exc)
        try:
            return propose(self, *args, **kwargs)
        finally:
            if choice is not None:
                choice.staged = None

    def _sample_draft_tokens(self, hidden_states, sampling_metadata, *args, **kwargs):
        choice = getattr(self, "_drelay_choice", None)
        if choice is not None and choice.staged is not None and not args and not kwargs:
            B = choice.staged.anchors.shape[0]
            if hidden_states.shape[0] == B * choice.num_slots and _argmax_is_plain(self):
                logits_fn, target_ids = self._drelay_logits  # set with the choice in load_model
                return choice.choose(logits_fn, hidden_states, target_ids), None
            choice.staged = None
            warn_once(
                "shape", "%d draft rows for %d requests (H = %d): native drafts", hidden_states.shape[0], B, choice.num_slots
            )
        return sample(self, hidden_states, sampling_metadata, *args, **kwargs)

    for fn, name in ((__init__, "__init__"), (_load_model, "load_model"), (_propose, "propose"),
                     (_sample_draft_tokens, "_sample_draft_tokens")):  # fmt: skip
        original = getattr(cls, name)
        fn.__name__, fn.__qualname__, fn.__doc__ = name, f"{cls.__name__}.{name}", original.__doc__
        fn.__wrapped__ = original
        setattr(cls, name, fn)


def _argmax_is_plain(proposer) -> bool:
    """True when vLLM's greedy draft is `compute_logits(h).argmax` (what the pool replaces)."""
    return not getattr(proposer, "use_local_argmax_reduction", False) and not getattr(proposer, "use_heterogeneous_vocab", False)


def build_choice(proposer, target_model):
    """A DraftChoice when the draft directory holds a selector; None (native) otherwise."""
    from deploy.vllm.draft_choice import DraftChoice, RequestRings
    from deploy.vllm.selector_dir import build_selector, read_selector_dir

    saved = read_selector_dir(proposer.draft_model_config.model)
    if saved is None:
        return None
    H = proposer.num_speculative_tokens
    if H != saved.drafter.num_slots:
        warn_once(
            "slots", "the selector decides %d slots but num_speculative_tokens is %d: native drafts", saved.drafter.num_slots, H
        )
        return None
    embed = _input_embedding(proposer, target_model)
    dtype = proposer.dtype  # the served dtype (the draft model's floating weights)
    selector = build_selector(saved, embed, dtype=dtype)
    n = selector.capabilities.history_len
    rings = None
    if n:
        dim = len(saved.drafter.target_layer_ids) * saved.drafter.hidden_size
        rings = RequestRings(proposer.max_batch_size, n, dim, dtype=dtype, device=embed.device)
    choice = DraftChoice(selector, num_slots=H, top_k=saved.drafter.top_k, rings=rings)
    if os.environ.get(RECORD_ENV):
        choice.recorder = _recorder(os.environ[RECORD_ENV])
    if os.environ.get(PROFILE_ENV):
        choice.profiler = _profiler(os.environ[PROFILE_ENV])
    logger.info("DRelay plugin: selector '%s' chooses the drafts (H=%d, K=%d, history %d)",
                saved.selector["name"], H, saved.drafter.top_k, n)  # fmt: skip
    return choice


def draft_vocab_logits(model):
    """(logits_fn, target_ids) for `DraftChoice.choose`: the draft model's LM head over its own
    vocabulary and that vocabulary's target ids [V_d] (`d2t`: target id = draft id + d2t[draft id]),
    when its `compute_logits` is exactly that head scattered into the target vocabulary with −inf
    elsewhere. Checked once on random hidden states, bit for bit; a model without a draft
    vocabulary, or whose `compute_logits` does anything else, keeps `(compute_logits, None)`."""
    import torch

    d2t = getattr(model, "draft_id_to_target_id", None)
    head, processor = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    if d2t is None or head is None or processor is None:
        return model.compute_logits, None

    def logits_fn(hidden):
        return processor(head, hidden)

    try:
        target_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t.to(torch.long)  # [V_d]
        weight = head.weight  # [V_d, D]
        with torch.inference_mode():
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
            full, draft = model.compute_logits(probe), logits_fn(probe)  # [3, V], [3, V_d]
            outside = torch.ones(full.shape[1], dtype=torch.bool, device=full.device)
            outside[target_ids] = False
            same = torch.equal(full[:, target_ids], draft) and bool(torch.isneginf(full[:, outside]).all())
    except Exception as exc:  # an unknown head: the full-vocabulary path is always right
        warn_once(
            "draft-vocab", "cannot read the draft vocabulary's logits (%s: %s); pool over the target's", type(exc).__name__, exc
        )
        return model.compute_logits, None
    if not same:
        warn_once("draft-vocab", "compute_logits is not the draft head scattered by d2t; pool over the target vocabulary")
        return model.compute_logits, None
    return logits_fn, target_ids


def _input_embedding(proposer, target_model):
    """The target's input embedding weight [≥ V, D] (the draft model shares it)."""
    for owner in (getattr(proposer.model, "model", None), getattr(target_model, "model", None)):
        embed = getattr(owner, "embed_tokens", None)
        if embed is not None and getattr(embed, "weight", None) is not None:
            return embed.weight
    return target_model.get_input_embeddings().weight


def stage(proposer, choice, args: dict) -> None:
    """Feed the step's verified features to the choice (see draft_choice.DraftChoice.stage)."""
    runner = proposer._drelay_runner
    cad = args["common_attn_metadata"]
    req_ids = runner.input_batch.req_ids
    B = cad.batch_size()
    if len(req_ids) != B:
        raise ValueError(f"{len(req_ids)} request ids for a batch of {B}")
    choice.stage(
        req_ids,
        runner.requests,
        hidden=args["target_hidden_states"],
        qsl=cad.query_start_loc[: B + 1],
        rejected=args.get("num_rejected_tokens_gpu"),
        positions=args["target_positions"],
        anchors=args["next_token_ids"][:B],
        max_query_len=cad.max_query_len,
    )


def _recorder(folder: str):
    """Save each step's pool, history and path as `step-<pid>-<n>.pt` under `folder`, until a file
    `PAUSE` appears there."""
    import torch

    os.makedirs(folder, exist_ok=True)
    counter = iter(range(10**9))

    def record(tensors: dict) -> None:
        if os.path.exists(os.path.join(folder, "PAUSE")):
            return
        cpu = {k: (v.detach().cpu() if v is not None else None) for k, v in tensors.items()}
        torch.save(cpu, os.path.join(folder, f"step-{os.getpid()}-{next(counter):06d}.pt"))

    return record


def _profiler(path: str):
    """Append each step's parts (DraftChoice.choose) to `path` as a JSON line, with this process's pid."""
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def profile(parts: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({**parts, "pid": os.getpid()}) + "\n")

    return profile
