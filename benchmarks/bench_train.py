"""Training throughput on Ray Train: 1 worker × 2 threads vs 2 workers × 1 thread, and peak memory.

    .venv/bin/python benchmarks/bench_train.py [--steps 30] [--data data/regenerated/smollm2-135m.jsonl]

Both runs use the same total threads (2), the same per-worker batch and the shipped smollm2-135m
config, for `--steps` steps each after a warm-up (the first checkpoint interval is excluded). Prints
training samples/s (sequences/s) of each and their ratio, and the peak resident memory of the whole
job (driver + every Ray process, sampled every 0.25 s). Results go to outputs/bench_train.json and
MLflow (experiment `drelay-benchmarks`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipelines.train.config import load_config  # noqa: E402
from pipelines.common.tracking import git_commit, hardware_description, tracked_run  # noqa: E402


class PeakMemory:
    """Samples the summed RSS of this process tree and every Ray process until stopped."""

    def __init__(self, period: float = 0.25) -> None:
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        total = 0
        for proc in psutil.process_iter(["pid", "cmdline", "memory_info"]):
            cmd = " ".join(proc.info.get("cmdline") or [])
            if proc.info["pid"] == os.getpid() or "ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or "ray/" in cmd:
                total += proc.info["memory_info"].rss if proc.info.get("memory_info") else 0
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.period)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_once(workers: int, threads: int, steps: int, data: str, tmp: Path) -> dict:
    """Train `steps` steps after a 10-step warm-up; samples/s over the timed steps only."""
    from pipelines.train.driver import run_training

    warm = 10
    cfg = load_config(
        ROOT / "platform/experiments/smollm2-135m/train.yaml",
        [
            f"data.regenerated={data}",
            f"train.max_steps={warm + steps}",
            f"train.checkpoint_every={warm}",
            f"train.validate_every={10 * (warm + steps)}",
            "train.validation_prompts=0",
            f"ray.num_workers={workers}",
            f"ray.cpus_per_worker={threads}",
            f"ray.storage_path={tmp}/ray",
            f"ray.run_name=bench-w{workers}",
            f"output_dir={tmp}/out",
            "mlflow.experiment=drelay-benchmarks",
        ],
    )
    shutil.rmtree(tmp / "ray" / f"bench-w{workers}", ignore_errors=True)
    with PeakMemory() as mem:
        result = run_training(cfg)
    seqs = cfg.train.seqs_per_step * workers * steps
    from pipelines.common.tracking import get_client

    client = get_client()
    out = {"workers": workers, "threads": threads, "steps": steps, "sequences": seqs, "peak_rss_gib": mem.peak / 2**30}
    for name in ("samples_per_s", "tokens_per_s"):
        timed = [m.value for m in client.get_metric_history(result.mlflow_run_id, f"throughput/{name}") if m.step > warm]
        out[name] = sum(timed) / len(timed) if timed else None  # intervals after the warm-up, equal length
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--data", default=str(ROOT / "data/regenerated/smollm2-135m.jsonl"))
    args = ap.parse_args()
    tmp = ROOT / "outputs" / "bench_train"
    tmp.mkdir(parents=True, exist_ok=True)
    import ray

    ray.init(num_cpus=2, include_dashboard=True, configure_logging=False)
    one = run_once(1, 2, args.steps, args.data, tmp)
    two = run_once(2, 1, args.steps, args.data, tmp)
    ray.shutdown()
    ratio = two["samples_per_s"] / one["samples_per_s"] if one["samples_per_s"] and two["samples_per_s"] else None
    report = {"one_worker": one, "two_workers": two, "ratio_2_over_1": ratio, "hardware": hardware_description()}
    (ROOT / "outputs" / "bench_train.json").write_text(json.dumps(report, indent=2))
    with tracked_run("drelay-benchmarks", run_name="bench_train", tags={"git_commit": git_commit()}) as run:
        run.log_metrics(
            {
                "train_samples_per_s_1w": one["samples_per_s"],
                "train_samples_per_s_2w": two["samples_per_s"],
                "ratio_2w_over_1w": ratio,
                "peak_rss_gib": max(one["peak_rss_gib"], two["peak_rss_gib"]),
            }
        )
    print(json.dumps(report, indent=2))
    print(
        f"\n2 workers × 1 thread vs 1 worker × 2 threads: {ratio:.2f}× training throughput; "
        f"peak job memory {max(one['peak_rss_gib'], two['peak_rss_gib']):.1f} GiB"
    )


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
