"""Trained selector heads beside a checkpoint's own (`drelay heads`, drelay_model/drafter/heads.py):
a head added from a checkpoint of the same drafter decodes with `--method <its selector>` exactly as
the checkpoint it came from (lossless), and every bad case is one line with nothing written."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.drafter import load_drafter, save_drafter
from drelay_model.drafter.heads import head_names, head_path
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry
from cli.main import main
from pipelines.common.methods import MethodSpec, load_method


def _checkpoint(path, drafter, name, tiny_selector_config, seed):
    torch.manual_seed(seed)
    sel = default_registry().create(name, drafter=drafter, config=tiny_selector_config(name))
    for p in sel.parameters():
        torch.nn.init.normal_(p, std=0.3)
    extra = {f"selector.{k}": v for k, v in sel.state_dict().items()}
    save_drafter(
        drafter, path, extra_tensors=extra, meta={"selector": {"name": name, "config": sel.config.to_dict()}, "step": seed}
    )
    return sel.eval()


@pytest.fixture()
def two_checkpoints(tmp_path, target, make_drafter, tiny_selector_config):
    if not target.name.startswith("tiny-llama"):
        pytest.skip("one architecture is enough")
    drafter = make_drafter(target, top_k=8)
    _checkpoint(tmp_path / "bundled", drafter, "drelay", tiny_selector_config, seed=1)
    stage = _checkpoint(tmp_path / "stage", drafter, "dflash2", tiny_selector_config, seed=2)
    return tmp_path / "bundled", tmp_path / "stage", stage


def test_an_added_head_decodes_as_its_source_and_is_lossless(two_checkpoints, target, prompts_of, hf_greedy, capsys):
    bundled, stage, stage_selector = two_checkpoints
    with pytest.raises(DRelayError, match="no trained 'dflash2' selector"):
        load_method(MethodSpec("dflash2", str(bundled)), target)
    assert main(["heads", "add", str(stage), str(bundled)]) == 0
    assert head_names(bundled) == ["dflash2"] and "--method dflash2" in capsys.readouterr().out
    assert main(["heads", "list", str(bundled)]) == 0 and "own selector drelay; heads: dflash2" in capsys.readouterr().out
    drafter, head = load_method(MethodSpec("dflash2", str(bundled)), target)
    for key, value in stage_selector.state_dict().items():
        assert torch.equal(head.state_dict()[key], value), key
    own_drafter, own = load_method(MethodSpec("drelay", str(bundled)), target)  # the checkpoint's own head is unchanged
    assert type(own).__name__ == "DRelaySelector"
    prompts, cfg = prompts_of(target.vocab_size, (5, 9)), GenerationConfig(max_new_tokens=16)
    via_head = SpeculativeEngine(target, drafter, head).generate(prompts, cfg)
    d2, _, _ = load_drafter(stage, target)
    via_source = SpeculativeEngine(target, d2, stage_selector).generate(prompts, cfg)
    assert via_head.tokens == via_source.tokens and via_head.stats.accept_hist.tolist() == via_source.stats.accept_hist.tolist()
    for b, p in enumerate(prompts):
        assert via_head.tokens[b] == hf_greedy(target, p, 16)


def test_bad_heads_are_one_line_errors_and_write_nothing(
    two_checkpoints, tmp_path, target, make_drafter, tiny_selector_config, capsys
):
    bundled, stage, _ = two_checkpoints
    other = make_drafter(target, seed=5, top_k=8)  # another drafter: its head must not ride on this one
    _checkpoint(tmp_path / "other", other, "dcoco", tiny_selector_config, seed=3)
    for args, message in (
        (["heads", "add", str(tmp_path / "other"), str(bundled)], "trained on another drafter"),
        (["heads", "add", str(stage), str(stage)], "already holds a trained 'dflash2'"),
        (["heads", "add", str(tmp_path / "missing"), str(bundled)], "not found"),
    ):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert head_names(bundled) == []
    assert main(["heads", "add", str(stage), str(bundled)]) == 0
    head_path(bundled, "dflash2").write_bytes(b"not a safetensors file")
    with pytest.raises(DRelayError, match="is corrupted"):
        load_method(MethodSpec("dflash2", str(bundled)), target)
    assert main(["heads", "add", str(stage), str(bundled)]) == 0  # re-adding replaces it
    retrained = save_drafter(other, tmp_path / "retrained")  # the checkpoint's drafter retrained since: its heads are stale
    for f in ("drafter.safetensors", "drafter_config.json"):
        (bundled / f).write_bytes((retrained / f).read_bytes())
    with pytest.raises(DRelayError, match="another drafter than the checkpoint's"):
        load_method(MethodSpec("dflash2", str(bundled)), target)


def test_a_checkpoint_replaced_by_one_of_the_same_drafter_keeps_its_heads(
    two_checkpoints, tmp_path, target, make_drafter, tiny_selector_config
):
    """What a study's `ship:` does: heads that fit the shipped drafter stay, stale ones and the new
    checkpoint's own selector do not."""
    from drelay_model.drafter.heads import carry_heads

    bundled, stage, _ = two_checkpoints
    assert main(["heads", "add", str(stage), str(bundled)]) == 0
    drafter, _, _ = load_drafter(bundled, target)
    _checkpoint(tmp_path / "new-drelay", drafter, "drelay", tiny_selector_config, seed=9)
    assert carry_heads(bundled, tmp_path / "new-drelay") == ["dflash2"] and head_names(tmp_path / "new-drelay") == ["dflash2"]
    _checkpoint(tmp_path / "new-dflash2", drafter, "dflash2", tiny_selector_config, seed=9)
    assert carry_heads(bundled, tmp_path / "new-dflash2") == []  # its own selector is DFlash-2 now
    _checkpoint(tmp_path / "new-drafter", make_drafter(target, seed=5, top_k=8), "drelay", tiny_selector_config, seed=9)
    assert carry_heads(bundled, tmp_path / "new-drafter") == []  # another drafter: the head would not fit
