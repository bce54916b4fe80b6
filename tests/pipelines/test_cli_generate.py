"""`drelay generate`: real runs on the bundled target, and one-line errors for bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from drelay_model.target import tiny_target
from cli import main


@pytest.fixture(autouse=True)
def _smollm2_loaded_once(request, monkeypatch):
    """`drelay generate` loads its target on every call, seconds for SmolLM2; here a call for SmolLM2 on
    the CPU in float32 gets the session's `smol` (the same `load_target` call's result), which the
    command only reads. Other targets, devices, dtypes and bad specs go through the real loader. The
    fixture is fetched on the first such call, so these tests keep the one intra-op thread they had."""
    import cli.generate as generate

    real = generate.load_target_spec

    def load(spec: str, *, device: str = "cpu", dtype: str = "float32"):
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        if spec == "smollm2-135m" and dtype == "float32" and on_cpu:
            return request.getfixturevalue("smol")
        return real(spec, device=device, dtype=dtype)

    monkeypatch.setattr(generate, "load_target_spec", load)


def _run(capsys, *argv):
    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_ar_generation_on_the_bundled_target(capsys):
    rc, out, err = _run(capsys, "--chat", "What is 2+3?", "--method", "ar", "--max-new-tokens", "8", "--json", "--verbose",
                        "--threads", "1", "--warmup")  # fmt: skip
    assert rc == 0, err
    report = json.loads(out)
    assert 1 <= report["generated_tokens"] <= 8  # EOS may end it early
    assert report["tau"] == 1.0 and report["outputs"][0].strip()
    kernels = [line for line in err.splitlines() if line.startswith("cpu kernels:")]  # --verbose: one line
    assert len(kernels) == 1 and "DRELAY_PACKED_LINEARS=" in kernels[0] and "→" in kernels[0], err
    threads = [line for line in err.splitlines() if line.startswith("threads ")]
    assert len(threads) == 1 and threads[0].startswith("threads 1 (fixed; OMP_WAIT_POLICY="), err


@pytest.mark.parametrize("length", ["cost", "fixed"])
def test_speculative_generation_reports_speedup_and_matches_ar(capsys, tmp_path, monkeypatch, length):
    from drelay_model.decoding.cost_policy import cache as costs

    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path)
    # One timed repetition of the cost surface instead of up to nine: the test checks that the surface
    # is measured once and cached and that decoding by it stays lossless, not the timings' precision.
    measure = costs.measure_costs
    monkeypatch.setattr(costs, "measure_costs", lambda *args, **kw: measure(*args, **{**kw, "reps": 1}))
    argv = [
        "--chat",
        "Name a colour.",
        "--random-drafter",
        "--compare-ar",
        "--max-new-tokens",
        "12",
        "--json",
        "--verify-length",
        length,
    ]
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    report = json.loads(out)
    assert report["same_output_as_ar"] is True and report["verify_length"] == length
    assert bool(list(tmp_path.glob("costs/*.json"))) == (length == "cost")  # measured once, cached
    assert report["speedup"] > 0 and report["ar_tokens_per_s"] > 0 and report["repeats"] == 3
    # the pooled tok/s ratio, inside its 95% interval over the 3 pairs, which holds every pair's own ratio's range
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["ar_tokens_per_s"])
    assert report["speedup_ci_low"] <= report["speedup"] <= report["speedup_ci_high"]
    assert len(report["speedups"]) == 3


def test_speedup_interval_is_printed_and_needs_three_repeats(capsys):
    """Text output: `speedup 1.21× [1.15, 1.27] (3 paired repeats)`; with 2 repeats no interval, and why
    (the JSON report's `speedup_ci_low` / `speedup_ci_high` are then null)."""
    argv = ["--chat", "Name a colour.", "--random-drafter", "--compare-ar", "--max-new-tokens", "6", "--verify-length", "fixed"]
    rc, out, err = _run(capsys, *argv, "--bootstrap-resamples", "500", "--bootstrap-seed", "3")
    assert rc == 0, err
    line = out.strip().splitlines()[-1]
    assert re.search(r"speedup \d+\.\d\d× \[\d+\.\d\d, \d+\.\d\d\] \(3 paired repeats\)", line), line
    rc, out, err = _run(capsys, *argv, "--repeats", "2")
    assert rc == 0 and "(2 paired repeats; an interval needs ≥ 3 repeats)" in out.strip().splitlines()[-1], out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--chat", "hi", "--target", "nope"], "unknown target 'nope'"),
        (["--chat", "hi", "--method", "magic", "--random-drafter"], "unknown method 'magic'"),
        (["--chat", "hi", "--checkpoint", "/no/such/dir"], "checkpoint '/no/such/dir' not found"),
        (["--chat", "hi", "--method", "ar", "--max-new-tokens", "0"], "--max-new-tokens must be an integer ≥ 1, got 0"),
        (["--chat", "hi", "--method", "ar", "--temperature", "nan"], "--temperature must be in [0, 100], got nan"),
        (["--chat", "hi", "--random-drafter", "--compare-ar", "--repeats", "0"], "--repeats must be ≥ 1"),
        (["--chat", "hi", "--compare-ar", "--bootstrap-resamples", "10"], "--bootstrap-resamples must be ≥ 100, got 10"),
        (["--chat", "hi", "--compare-ar", "--bootstrap-seed", "-1"], "--bootstrap-seed must be ≥ 0, got -1"),
        (["--prompts-file", "/no/file.txt", "--method", "ar"], "not found"),
        (["--chat", "word " * 9000, "--method", "ar"], "context window"),
        (["--chat", "hi", "--method", "ar", "--threads", "two"], "--threads must be a positive integer or auto, got 'two'"),
        (["--chat", "hi", "--method", "ar", "--threads", "0"], "--threads must be a positive integer or auto, got 0"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(capsys, argv, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_no_bundled_checkpoint_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("pipelines.common.paths.BUNDLED_CHECKPOINTS", tmp_path / "none")
    rc, _, err = _run(capsys, "--chat", "hi")
    assert rc == 2 and "needs a drafter checkpoint" in err and err.count("\n") == 1


BUNDLED = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m"


@pytest.mark.skipif(not BUNDLED.is_dir(), reason="no trained drafter bundled in checkpoints/smollm2-135m")
@pytest.mark.parametrize("method", ["native", "drelay", *sorted(p.stem for p in (BUNDLED / "heads").glob("*.safetensors"))])
def test_bundled_checkpoint_is_small_trained_and_lossless(capsys, method):
    """The shipped CPU default: ≤ 50 MB of safetensors, holds the DRelay selector and any head installed
    beside it (heads/), and decodes exactly the target's greedy output with each (one timed pair
    with AR: the speedup's median over pairs is another test's)."""
    assert sum(f.stat().st_size for f in BUNDLED.rglob("*") if f.is_file()) <= 50 * 2**20
    rc, out, err = _run(capsys, "--chat", "What is 12 times 7? Explain briefly.", "--method", method, "--compare-ar",
                        "--max-new-tokens", "48", "--json", "--verify-length", "fixed", "--repeats", "1")  # fmt: skip
    assert rc == 0, err
    report = json.loads(out)
    assert report["same_output_as_ar"] is True and report["tau"] > 1.0


def test_checkpoint_for_another_target_is_rejected(capsys, tmp_path):
    tiny = tiny_target("tiny-llama")
    save_drafter(BlockDrafter(DrafterConfig.for_target(tiny, num_layers=1), tiny), tmp_path / "ckpt")
    rc, _, err = _run(capsys, "--chat", "hi", "--checkpoint", str(tmp_path / "ckpt"))
    assert rc == 2 and "does not match target 'smollm2-135m'" in err


def test_console_script_never_prints_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "--chat", "hi", "--target", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "drelay: error: unknown target 'nope': expected smollm2-135m, tiny-llama, tiny-qwen3, a Hugging Face model directory, or a hub id 'org/name'"
    )


def test_a_command_builds_only_its_own_parser(capsys):
    """`drelay jobs …` imports the jobs command and nothing that loads models: neither torch nor
    transformers is imported, and its help still comes from the jobs module. `drelay --help` lists every
    command; a word that is no command gets argparse's own error with the list."""
    from cli.main import COMMANDS, requested_command

    assert requested_command(["serve-bench", "--config", "x"]) == "serve_bench" and requested_command(["--help"]) is None
    assert requested_command(["nope"]) is None and requested_command([]) is None
    assert requested_command(["--help", "jobs"]) is None  # `drelay --help` lists every command
    probe = ("import sys; from cli.main import main\n"
             "try:\n    main(['jobs', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
             "print(sorted({'torch', 'transformers'} & set(sys.modules)))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("[]"), proc.stdout + proc.stderr
    assert "usage: drelay jobs" in proc.stdout
    for argv, code in ((["--help"], 0), (["nope"], 2)):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        out = capsys.readouterr()
        assert exit_.value.code == code and all(name.replace("_", "-") in out.out + out.err for name in COMMANDS)
    assert "invalid choice: 'nope'" in out.err


TINY = ["--target", "tiny-llama"]


def test_costs_command_measures_caches_and_shows(capsys, tmp_path, monkeypatch):
    """The command's measuring, caching and showing, on the tiny target: timing only, so the model's size
    does not matter, and its rounds take milliseconds where SmolLM2's take tens (a drafter's block is
    16 positions on either)."""
    monkeypatch.setattr("drelay_model.decoding.cost_policy.cache.cache_root", lambda: tmp_path)
    # whatever else this machine runs meanwhile, a surface counts as quiet until the check below
    monkeypatch.setattr("drelay_model.decoding.cost_policy.cache.BUSY_CORES", float("inf"))
    small = ["--max-batch", "2", "--reps", "1"]  # the surface at b = 1, 2: seconds
    assert main(["costs", *TINY, "--random-drafter", "--show"]) == 2 and "run without --show" in capsys.readouterr().err
    assert main(["costs", *TINY, "--random-drafter", "--json", *small]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["batch_sizes"] == [1, 2] and [len(r) for r in measured["verify_ms"]] == [16, 16]
    assert all(t > 0 for r in measured["verify_ms"] for t in r) and [len(r) for r in measured["draft_slots_ms"]] == [15, 15]
    assert main(["costs", *TINY, "--random-drafter", "--show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == measured
    assert main(["costs", *TINY, "--random-drafter", "--show", "--batch", "1", "2", "3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("batch sizes measured: 1, 2") and [line.split()[0] for line in table[3:]] == ["1", "2", "3"]
    (cached,) = tmp_path.glob("costs/*.json")  # a file of an older measurement is measured again
    cached.write_text(json.dumps({**measured, "version": 3}))
    assert main(["costs", *TINY, "--random-drafter", "--show", "--json", *small]) == 0
    out, err = capsys.readouterr()
    assert "predate" in err and json.loads(out)["batch_sizes"] == [1]  # --show asks for no batch size beyond 1
    remeasured = json.loads(out)  # a surface measured on a busy machine is measured again
    monkeypatch.setattr("drelay_model.decoding.cost_policy.cache.BUSY_CORES", 0.5)
    cached.write_text(json.dumps({**remeasured, "busy_cores": 1.5}))
    assert main(["costs", *TINY, "--random-drafter", "--show", "--json", *small]) == 0
    assert "other processes used 1.5 cores: re-measuring" in capsys.readouterr().err
    assert main(["costs", *TINY, "--method", "ar"]) == 2 and "no drafting costs" in capsys.readouterr().err
    assert main(["costs", *TINY, "--random-drafter", "--reps", "0"]) == 2 and "--reps" in capsys.readouterr().err
    assert main(["costs", *TINY, "--random-drafter", "--max-batch", "0"]) == 2 and "--max-batch" in capsys.readouterr().err
    # another CPU model (a home directory shared by cluster nodes) gets its own surface
    monkeypatch.setattr("drelay_model.decoding.cost_policy.cache.processor_model", lambda device: "Another CPU")
    assert main(["costs", *TINY, "--random-drafter", "--show"]) == 2 and "run without --show" in capsys.readouterr().err
    assert main(["costs", *TINY, "--random-drafter", "--json", "--max-batch", "1", "--reps", "1"]) == 0
    assert len(list(tmp_path.glob("costs/*.json"))) == 2
    capsys.readouterr()


def test_cost_curves_are_kept_apart_by_the_cpu_kernels_that_take_effect():
    """A drafter without int8 short blocks, or a target without packed linears, drafts and verifies at
    other costs: another file. The settings come from the models; nothing else in the process changes."""
    from drelay_model.kernels.cpu_linear import CpuKernels, available, int8_kernel
    from drelay_model.decoding.cost_policy import costs_path

    if not (available() and int8_kernel()):
        pytest.skip("this torch build has no packed linears or no weight-only int8 matmul")
    names = {}
    for label, kernels in {"on": CpuKernels(), "no-int8": CpuKernels(int8_draft=False), "off": CpuKernels(packed=False)}.items():
        target = tiny_target("tiny-llama", cpu_kernels=kernels)
        drafter = BlockDrafter(DrafterConfig.for_target(target), target)
        names[label] = costs_path(target, drafter, None, method="native").name
    assert "-packed" in names["on"] and "int8-blocks" in names["on"]
    assert "-packed" in names["no-int8"] and "int8-blocks" not in names["no-int8"]
    assert "-packed" not in names["off"] and "rank" not in names["off"] and len(set(names.values())) == 3


def test_device_flag_cuda_without_cuda_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, _, err = _run(capsys, "--chat", "hi", "--method", "ar", "--device", "cuda")
    assert rc == 2 and "cuda" in err.lower() and err.count("\n") == 1
