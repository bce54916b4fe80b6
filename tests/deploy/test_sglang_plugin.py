"""The SGLang plugin: importable without SGLang, declared as an entry point, its pure-torch parts
(ring feeding, argument checks, model package) on CPU; registration and loading where SGLang runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deploy.sglang.history import RequestFeatureRing
from deploy.sglang.plugin import ALGORITHM, validate_server_args
from deploy.sglang.ring_feed import PrefillTracker, feed_prefill, feed_verify, plan_prefill
from drelay_model.decoding.history import VerifiedHistory

ROOT = Path(__file__).resolve().parents[2]
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(
    not (HAVE_SGLANG and torch.cuda.is_available()), reason="needs SGLang installed (docs/sglang.md) and a GPU"
)


def test_plugin_and_model_package_import_without_sglang():
    code = (
        "import sys, deploy.sglang.plugin, deploy.sglang.models.drelay_draft as m; "
        "assert 'sglang' not in sys.modules; print(m.EntryClass.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "DRelayDraftModel"


def test_entry_point_is_declared():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    module, func = eps["drelay"].split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_server_args_are_checked_with_one_line_errors():
    validate_server_args(SimpleNamespace(speculative_draft_model_path="/x", speculative_num_draft_tokens=16))
    for args, needle in [
        (SimpleNamespace(speculative_draft_model_path=None), "--speculative-draft-model-path"),
        (SimpleNamespace(speculative_draft_model_path="/x", speculative_num_draft_tokens=1), "--speculative-num-draft-tokens"),
    ]:
        with pytest.raises(ValueError, match=needle) as exc:
            validate_server_args(args)
        assert "\n" not in str(exc.value)


def test_ring_feed_matches_the_engine_history_for_prefill_then_verify():
    g = torch.Generator().manual_seed(0)
    N, Fd, S = 6, 3, 4
    ring, engine = RequestFeatureRing(5, N, Fd), VerifiedHistory(2, N, Fd)
    slots = torch.tensor([4, 1])
    packed = torch.randn(11 + 3, Fd, generator=g)  # packed prefill: 9 + 2 rows, then 3 padding rows
    feed_prefill(ring, slots, packed, plan_prefill([9, 2], [True, True], size=N))
    padded = torch.zeros(2, 9, Fd)
    padded[0], padded[1, :2] = packed[:9], packed[9:11]
    engine.push(padded, torch.tensor([9, 2]))
    for _ in range(3):  # verify rounds: dense [bs·S, F], commit_lens verified per row
        dense, commit = torch.randn(2 * S, Fd, generator=g), torch.randint(1, S + 1, (2,), generator=g)
        feed_verify(ring, slots, dense, commit.to(torch.int32))
        engine.push(dense.view(2, S, Fd), commit)
    feats, mask = ring.read(slots)
    assert torch.equal(feats, engine.feats) and torch.equal(mask, engine.mask())


def test_prefill_plan_keeps_each_chunks_last_n_rows_only():
    """The feed gathers at most N rows per request (never [bs, longest prompt, L·D])."""
    plan = plan_prefill([100, 3, 7], [True, False, True], size=4)
    assert plan.rows.tolist() == [0] * 4 + [1] * 3 + [2] * 4
    assert plan.tokens.tolist() == [96, 97, 98, 99, 100, 101, 102, 106, 107, 108, 109]
    assert plan.offsets.tolist() == [96, 97, 98, 99, 0, 1, 2, 3, 4, 5, 6]
    assert plan.fresh.tolist() == [0, 2] and plan.lens.tolist() == [100, 3, 7]


def test_tracker_tells_a_chunked_continuation_from_a_fresh_start():
    t = PrefillTracker()
    assert t.fresh_rows([3, 5], ["a", "b"], [0, 0], [8, 8]) == [True, True]
    assert t.fresh_rows([3], ["a"], [8], [8]) == [False]  # the next chunk of request a
    assert t.fresh_rows([5], ["c"], [8], [4]) == [True]  # a new request in b's slot, after a radix hit
    t.decoded([3])
    assert t.fresh_rows([3], ["a"], [16], [2]) == [True]  # retracted and prefilled again


@pytest.mark.sglang
@needs_sglang
def test_drelay_registers_as_a_dflash_family_algorithm():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from deploy.sglang.plugin import register

    register()
    register()  # idempotent
    algo = SpeculativeAlgorithm.from_string(ALGORITHM.lower())
    assert algo.is_dflash_family() and algo.supports_overlap


@pytest.mark.sglang
@needs_sglang
def test_exported_checkpoint_loads_through_sglang_model_registry(tmp_path):
    from deploy.sglang.export import export_sglang
    from tests.deploy.test_sglang_export import trained_checkpoint
    from drelay_model.target import tiny_target

    trained_checkpoint(tiny_target("tiny-qwen3", layers=4), tmp_path / "ckpt")
    out = export_sglang(tmp_path / "ckpt", tmp_path / "out", dtype="float32", context_length=4096)
    code = (
        "from sglang.srt.models.registry import ModelRegistry; "
        "cls, arch = ModelRegistry.resolve_model_cls(['DRelayDraftModel']); print(cls.__module__)"
    )
    env = {"PYTHONPATH": str(ROOT), "SGLANG_EXTERNAL_MODEL_PACKAGE": "deploy.sglang.models", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "deploy.sglang.models" in res.stdout, res.stderr[-2000:]
    assert (out / "config.json").is_file()


@pytest.mark.sglang
@needs_sglang
def test_server_args_parse_with_drelay(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    from deploy.sglang.plugin import register

    register()
    args = prepare_server_args(
        [
            "--model-path",
            str(tmp_path),
            "--speculative-algorithm",
            ALGORITHM,
            "--speculative-draft-model-path",
            str(tmp_path),
            "--speculative-num-draft-tokens",
            "16",
        ]
    )
    assert str(args.speculative_algorithm).upper() == ALGORITHM
