"""The registry round trip: a training run's drafter → registered model version with alias
`champion` → `drelay eval --checkpoint models:/<name>@champion` runs and links back to the run."""

from __future__ import annotations

import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from cli import main
from pipelines.common.outputs import OUTPUT_ROOT_ENV
from pipelines.common.provenance import write_provenance
from pipelines.common.registry import register_checkpoint, resolve_checkpoint
from pipelines.common.run_tags import CHECKPOINT_RUN, run_tags
from pipelines.common.tracking import get_client, tracked_run


def _training_run(tiny, tmp_path, uri) -> str:
    """What `drelay train` leaves behind, minus the training: a run with a drafter/ artifact folder."""
    torch.manual_seed(0)
    ckpt = tmp_path / "train" / "drafter"
    save_drafter(BlockDrafter(DrafterConfig.for_target(tiny), tiny), ckpt)
    with tracked_run("drelay-train", run_name="tiny-train", tags=run_tags("train", target="tiny-llama", method="native")) as run:
        write_provenance(ckpt, run_id=run.run_id, tracking_uri=uri, experiment="drelay-train")
        run.log_artifact(ckpt, artifact_path="drafter")  # nested as drafter/drafter/, as the driver does
    return run.run_id


def test_register_resolve_and_eval_through_champion(tiny, uri, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(tmp_path / "root"))
    first, second = _training_run(tiny, tmp_path / "a", uri), _training_run(tiny, tmp_path / "b", uri)
    assert register_checkpoint(first, "drelay-tiny") == "1"
    assert register_checkpoint(second, "drelay-tiny") == "2"  # the alias moves to the newest
    client = get_client()
    assert client.get_model_version_by_alias("drelay-tiny", "champion").run_id == second

    local = resolve_checkpoint("models:/drelay-tiny@champion")
    assert local == str(tmp_path / "root" / "cache" / "models" / "drelay-tiny" / "2")
    assert resolve_checkpoint("models:/drelay-tiny/1").endswith("/drelay-tiny/1")
    assert resolve_checkpoint("/some/dir") == "/some/dir"

    rc = main(["eval", "--target", "tiny-llama", "--methods", "ar,native", "--checkpoint", "models:/drelay-tiny@champion",
               "--data-dir", str(data_dir), "--benchmarks", "gsm8k", "--limit", "1", "--max-new-tokens", "6", "--no-progress",
               "--run-name", "champ"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    exp = client.get_experiment_by_name("drelay-eval")
    native = client.search_runs([exp.experiment_id], "tags.`drelay.level` = 'method' and tags.`drelay.method` = 'native'")
    assert native[0].data.tags[CHECKPOINT_RUN] == second  # the eval links back to the training run
    metrics = native[0].data.metrics
    assert metrics["tau"] == metrics["mean_tau"] >= 1.0 and metrics["speedup"] == metrics["mean_speedup"]  # headline


def test_bad_model_references_are_one_line(uri, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(tmp_path / "root"))
    for ref, message in (("models:/nope@champion", "not in the registry"), ("models:/x@", "expected models:/<name>@<alias>")):
        rc = main(["eval", "--target", "tiny-llama", "--methods", "ar,native", "--checkpoint", ref, "--limit", "1"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "root" / "cache").exists()
