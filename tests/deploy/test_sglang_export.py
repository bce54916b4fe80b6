"""`drelay export --format sglang`: the export loads back into `DRelayDraftModel` with identical
weights, identical drafter and selector outputs and identical greedy decoding; bad input is one
line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from deploy.sglang.export import export_sglang, main
from deploy.sglang.model import ARCHITECTURE, DRelayDraftModel, exported_name, internal_name
from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from drelay_model.errors import DRelayError
from drelay_model.selectors import SelectionContext, default_registry
from drelay_model.target import tiny_target

SEL_CFG = {"d_sel": 32, "heads": 4, "read_dim": 16, "history_len": 8, "compact_dim": 16, "ffn_mult": 2}


@pytest.fixture(scope="module")
def target():
    return tiny_target("tiny-qwen3", layers=4)  # features from layers 1, 2: never the last (SGLang cannot capture it)


def trained_checkpoint(target, path, *, draft_vocab: int | None = None):
    """A drafter + perturbed drelay selector saved the way training saves them."""
    torch.manual_seed(0)
    d2t = torch.randperm(target.vocab_size)[:draft_vocab].sort().values if draft_vocab else None
    cfg = DrafterConfig.for_target(target, num_layers=2, top_k=6, draft_vocab_size=draft_vocab)
    drafter = BlockDrafter(cfg, target, draft_to_target=d2t).eval()
    with torch.no_grad():  # not the initial values: a round trip must carry real weights
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    selector = default_registry().create("drelay", drafter=drafter, config=SEL_CFG).eval()
    with torch.no_grad():
        for p in selector.residual_heads():
            p.copy_(torch.randn_like(p))
        selector.causal.head.bias[1] += 4.0  # biased towards REPAIR
    extra = {f"selector.{k}": v for k, v in selector.state_dict().items()}
    save_drafter(drafter, path, extra_tensors=extra, meta={"selector": {"name": "drelay", "config": selector.config.to_dict()}})
    return drafter, selector


def test_names_round_trip():
    ours = [
        "fc.weight",
        "ctx_norm.weight",
        "mask_embedding",
        "norm.weight",
        "draft_to_target",
        "selector.causal.head.weight",
        *(f"layers.3.{p}.weight" for p in ("in_norm", "post_norm", "q_proj", "k_norm", "gate_proj", "down_proj")),
    ]
    assert [internal_name(exported_name(n)) for n in ours] == ours
    assert exported_name("layers.3.q_proj.weight") == "layers.3.self_attn.q_proj.weight"
    assert exported_name("ctx_norm.weight") == "hidden_norm.weight"


@pytest.mark.parametrize("draft_vocab", [None, 200])
def test_export_round_trip_is_lossless(target, tmp_path, draft_vocab):
    drafter, selector = trained_checkpoint(target, tmp_path / "ckpt", draft_vocab=draft_vocab)
    assert (
        main(
            [
                "--format",
                "sglang",
                "--context-length",
                "4096",
                "--dtype",
                "float32",
                str(tmp_path / "ckpt"),
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["num_hidden_layers"] == 2
    from transformers import AutoConfig  # SGLang reads the draft config this way while parsing args

    hf = AutoConfig.from_pretrained(tmp_path / "out")
    assert hf.architectures == [ARCHITECTURE] and DRelayDraftModel(hf).drafter_config == drafter.config
    loaded = DRelayDraftModel.from_pretrained(tmp_path / "out", target)
    a, b = drafter.state_dict(), loaded.drafter.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Identical drafter outputs and selector decisions on the same inputs.
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 11, len(drafter.config.target_layer_ids) * target.hidden_size, generator=g)
    anchors, pos = torch.randint(0, target.vocab_size, (2, 2), generator=g), torch.tensor([[3, 7], [5, 10]])
    with torch.no_grad():
        h0, h1 = drafter(anchors, pos, feats), loaded.drafter(anchors, pos, feats)
    assert torch.equal(h0, h1)
    block = drafter.pool(h0[:, 0, 1:])
    ctx = SelectionContext(
        anchor_ids=anchors[:, 0],
        anchor_pos=pos[:, 0],
        row_ids=torch.arange(2),
        history=torch.randn(2, 8, feats.shape[-1], generator=g),
        history_mask=torch.ones(2, 8, dtype=torch.bool),
    )
    s0, s1 = selector.select_with_scores(block, ctx), loaded.selector.select_with_scores(block, ctx)
    assert torch.equal(s0.selection.path_ids, s1.selection.path_ids)
    assert torch.equal(s0.output.gate, s1.output.gate)
    # Identical greedy decoding (and equal to the target's own: lossless).
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    cfg_gen = GenerationConfig(max_new_tokens=20)
    ref = SpeculativeEngine(target, drafter, selector).generate(prompts, cfg_gen)
    got = SpeculativeEngine(target, loaded.drafter, loaded.selector).generate(prompts, cfg_gen)
    ar = SpeculativeEngine(target).generate(prompts, cfg_gen)
    assert got.tokens == ref.tokens == ar.tokens
    assert got.stats.accept_hist.tolist() == ref.stats.accept_hist.tolist()


def _no_output(tmp_path, name="out"):
    return not (tmp_path / name).exists() and not list(tmp_path.glob(f"{name}.tmp.*"))


def test_bad_input_is_one_line_exit_2_and_writes_nothing(target, tmp_path, capsys):
    trained_checkpoint(target, tmp_path / "ckpt")
    cases = {
        "missing": (
            ["--format", "sglang", "--context-length", "4096", str(tmp_path / "nope"), str(tmp_path / "out")],
            "not found",
        ),
        "format": (["--format", "vllm", "--context-length", "4096", str(tmp_path / "ckpt"), str(tmp_path / "out")], "--format"),
        "no context": (["--format", "sglang", str(tmp_path / "ckpt"), str(tmp_path / "out")], "--context-length"),
        "bad context": (
            ["--format", "sglang", "--context-length", "0", str(tmp_path / "ckpt"), str(tmp_path / "out")],
            "--context-length",
        ),
    }
    for args, needle in cases.values():
        with pytest.raises(SystemExit) as exc:
            main(args)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and needle in err and "\n" not in err and "Traceback" not in err
        assert _no_output(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["--format", "sglang", "--context-length", "4096", str(tmp_path / "ckpt"), str(tmp_path / "full")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "already exists" in err and "\n" not in err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "ckpt" / "drafter.safetensors").write_bytes(b"garbage")
    with pytest.raises(SystemExit) as exc:
        main(["--format", "sglang", "--context-length", "4096", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert exc.value.code == 2 and "corrupted" in capsys.readouterr().err and _no_output(tmp_path)


def test_export_into_an_empty_directory_and_function_api(target, tmp_path):
    trained_checkpoint(target, tmp_path / "ckpt")
    (tmp_path / "empty").mkdir()
    export_sglang(tmp_path / "ckpt", tmp_path / "empty", dtype="float32", context_length=4096)
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_drelay_export_command_writes_the_same_directory(tmp_path, capsys):
    """`drelay export` (the CLI entry users run) exports, and refuses to overwrite in one line. The
    context length defaults to the target's (`--target`), and a given one is checked against it."""
    from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
    from drelay_model.target import tiny_target
    from cli import main

    tiny = tiny_target("tiny-llama", layers=4)  # max_position_embeddings 1024
    save_drafter(BlockDrafter(DrafterConfig.for_target(tiny, num_layers=1), tiny), tmp_path / "ckpt")
    ckpt, target = str(tmp_path / "ckpt"), ["--target", "tiny-llama:layers=4"]

    def export(*args: str) -> tuple[int, str]:
        rc = main(["export", "--format", "sglang", *args])
        return rc, capsys.readouterr().err

    def carried(out: str) -> int:
        return json.loads((tmp_path / out / "config.json").read_text())["max_position_embeddings"]

    assert export(*target, ckpt, str(tmp_path / "out"))[0] == 0 and carried("out") == 1024  # the target's own
    rc, err = export(*target, ckpt, str(tmp_path / "out"))
    assert rc == 2 and "already exists" in err and err.count("\n") == 1
    assert export(*target, "--context-length", "512", ckpt, str(tmp_path / "short"))[0] == 0 and carried("short") == 512
    rc, err = export(*target, "--context-length", "4096", ckpt, str(tmp_path / "long"))
    assert rc == 2 and "--context-length: 4096 exceeds the target's context length 1024" in err and err.count("\n") == 1
    rc, err = export(*target, "--context-length", "0", ckpt, str(tmp_path / "zero"))
    assert rc == 2 and "--context-length" in err and err.count("\n") == 1
    rc, err = export("--target", "tiny-llama:layers=6", ckpt, str(tmp_path / "other"))  # not the drafter's target
    assert rc == 2 and err.startswith("drelay: error: --target:") and err.count("\n") == 1
    assert not any((tmp_path / name).exists() for name in ("long", "zero", "other"))


def test_export_is_bf16_by_default_with_a_matching_torch_dtype(target, tmp_path):
    """SGLang's `--dtype auto` reads `torch_dtype`: a float32 draft config would load as float16
    beside a bf16 target. The default export is bf16 throughout; `--dtype` picks another."""
    from safetensors.torch import load_file

    trained_checkpoint(target, tmp_path / "ckpt")
    assert main(["--format", "sglang", "--context-length", "4096", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert cfg["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    export_sglang(tmp_path / "ckpt", tmp_path / "f16", dtype="float16", context_length=4096)
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["torch_dtype"] == "float16"
    with pytest.raises(SystemExit) as exc:
        main(["--format", "sglang", "--context-length", "4096", "--dtype", "int8", str(tmp_path / "ckpt"), str(tmp_path / "bad")])
    assert exc.value.code == 2 and not (tmp_path / "bad").exists()


def test_export_refuses_the_last_target_layer_as_a_feature_layer(tmp_path):
    """SGLang captures layer k's output before layer k+1 runs: the last layer never gets captured."""
    t = tiny_target("tiny-qwen3", layers=3)
    drafter = BlockDrafter(DrafterConfig.for_target(t, num_layers=1, target_layer_ids=(0, 2)), t)
    save_drafter(drafter, tmp_path / "ckpt")
    with pytest.raises(DRelayError, match="last layer 2"):
        export_sglang(tmp_path / "ckpt", tmp_path / "out", context_length=4096)
    assert not (tmp_path / "out").exists()


def test_gpu_check_exports_its_random_drafter_on_a_tokenizer_less_target(tmp_path):
    """benchmarks/gpu/sglang_check.py's export step, on a tiny 4-layer target built in memory."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "sglang_check.py"
    spec = importlib.util.spec_from_file_location("sglang_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    check._export_random_drafter(tiny_target("tiny-qwen3", layers=4), tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2] and cfg["torch_dtype"] == "bfloat16"
