"""The worker's selector seam against SGLang's real request pool and model registry/loader."""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.sglang_cpu


def test_seam_fits_every_request_pool_slot_and_batch(dirs):
    """SGLang's ReqToTokenPool hands out slots 1..size (row 0 is padding); the worker sizes the ring
    and the slot buffer from the pool itself, so the last slot and a batch of every request (an
    eager or prefill batch, larger than any captured one) fit."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from deploy.sglang.plugin import install_selector_seam
    from deploy.sglang.ring_feed import feed_prefill, plan_prefill
    from deploy.sglang.runner import DRelayRunnerModel
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    import json

    size = 6
    pool = ReqToTokenPool(size=size, max_context_len=64, device="cpu", enable_memory_saver=False)
    slots = []
    while pool.available_size():
        slots.append(pool.free_slots.pop(0))
    assert sorted(slots) == list(range(1, size + 1))
    model = DRelayRunnerModel(json.loads((dirs["draft"] / "config.json").read_text()))
    model.load_weights(safetensors_weights_iterator([str(dirs["draft"] / "model.safetensors")]))
    model.bind_selector(dirs["embed"])
    seam = install_selector_seam(model, pool, device="cpu")
    assert model.candidate_selector is seam
    idx = torch.tensor(slots)
    F = seam.history.buf.shape[-1]
    feed_prefill(seam.history, idx, torch.randn(3 * size, F), plan_prefill([3] * size, [True] * size, size=seam.history.size))
    seam.stage_requests(idx)
    H, K, D = 15, seam.top_k, model.drafter_config.hidden_size
    cand = torch.randint(0, 256, (size, H, K))
    scores = seam.build_lattice(cand, torch.log_softmax(torch.randn(size, H, K), -1), torch.randn(size, H, D), cand[:, 0, 0])
    assert scores.shape == (size, H, K)


def test_export_resolves_through_sglang_model_registry():
    """SGLANG_EXTERNAL_MODEL_PACKAGE=deploy.sglang.models registers the export's architecture."""
    from sglang.srt.models.registry import ModelRegistry

    from deploy.sglang.models.drelay_draft import DRelayDraftModel

    cls, arch = ModelRegistry.resolve_model_cls(["DRelayDraftModel"])
    assert cls is DRelayDraftModel and arch == "DRelayDraftModel"


def test_weights_load_through_sglang_iterator(dirs):
    """SGLang's safetensors iterator (its default loader's) feeds the runner every exported tensor."""
    import json

    from safetensors.torch import load_file
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    from deploy.sglang.runner import DRelayRunnerModel

    model = DRelayRunnerModel(json.loads((dirs["draft"] / "config.json").read_text()))
    model.load_weights(safetensors_weights_iterator([str(dirs["draft"] / "model.safetensors")]))
    saved = load_file(str(dirs["draft"] / "model.safetensors"))
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, tensor in saved.items():
        got = own.get(name, model.extra_tensors.get(name))
        assert got is not None and torch.equal(got, tensor.to(got.dtype)), name


def test_statistics_names_are_the_ones_sglang_emits():
    """The meta_info keys SGLang's tokenizer manager writes (parsed from its source) include every
    key our serve backend reads."""
    import ast
    import inspect

    from sglang.srt.managers import tokenizer_manager

    from deploy.sglang.stats import SPEC_META_KEYS

    tree = ast.parse(inspect.getsource(tokenizer_manager))
    emitted = {
        node.slice.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "meta_info"
        and isinstance(node.slice, ast.Constant)
        and str(node.slice.value).startswith("spec_")
    }
    assert {"spec_verify_ct", "spec_correct_drafts_histogram", "spec_accept_rate", "spec_num_correct_drafts"} <= emitted
    assert set(SPEC_META_KEYS) <= emitted, set(SPEC_META_KEYS) - emitted


def test_venv_holds_sglangs_pinned_versions():
    """`make sglang-env` installs what SGLang 0.5.23 pins for the packages our tests touch."""
    from importlib.metadata import requires, version

    pins = dict(
        re.match(r"([A-Za-z0-9_.-]+)==([^;\s]+)$", r).groups()
        for r in requires("sglang")
        if re.match(r"[A-Za-z0-9_.-]+==[^;\s]+$", r)
    )
    for name in ("torch", "transformers", "tokenizers", "openai", "sentencepiece", "apache-tvm-ffi", "compressed-tensors"):
        assert version(name).split("+")[0] == pins[name], name


def test_our_endpoints_sglext_uses_sglangs_field_names():
    """Every SGLang statistic our endpoint's `sglext` returns is named as in SGLang's OpenAI
    protocol (`SpecTokensDetails`); `spec_drafted_ct` / `spec_verify_length` (engine backend) and
    `method` are ours."""
    from sglang.srt.entrypoints.openai.protocol import SpecTokensDetails

    from deploy.serve.backends.base import SpecStats

    ext = SpecStats(verify_ct=2, accept_histogram=[0, 1, 1], completion_tokens=5, drafted_ct=2, verified_drafts=6).sglext(
        "drelay"
    )
    ours = {"spec_drafted_ct", "spec_verify_length", "method"}
    assert set(ext) - ours <= set(SpecTokensDetails.model_fields), set(ext) - ours - set(SpecTokensDetails.model_fields)
    assert ext["spec_correct_drafts_histogram"] == [0, 1, 1] and ext["spec_accept_length"] == 2.5
