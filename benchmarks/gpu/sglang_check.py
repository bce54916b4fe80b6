"""GPU check for DRelay inside SGLang (run on a CUDA machine; nothing here runs on CPU).

    python benchmarks/gpu/sglang_check.py kernels [--out DIR]   # Triton vs PyTorch selector, Qwen3-4B shapes
    python benchmarks/gpu/sglang_check.py server  [--out DIR]   # SGLang + DRELAY plugin vs SGLang AR
    python benchmarks/gpu/sglang_check.py all     [--out DIR]

kernels: the DRelay selector at Qwen3-4B shapes (H = 15, K = 16, hidden 2,560, features from 5
  target layers = 12,800 wide, vocab 151,936, default DRelayConfig), bf16, batch 1/8/32: time per
  round (Global Read + walk, CUDA events, median of 50 after 10 warm-up) with `kernels="torch"` and
  `kernels="triton"`, and whether both pick the same paths.
server: a random Qwen3-shaped target (4 layers, hidden 2,560, vocab 151,936) saved as an HF
  directory, a random drafter + selector for it exported with `drelay export --format sglang`,
  then two SGLang servers on the same target: plain AR and `--speculative-algorithm DRELAY`;
  greedy /generate outputs must be identical token for token, and the spec statistics
  (meta_info spec_verify_ct / spec_accept_length, and `sglext` on /v1/completions with
  return_spec_tokens_details) are read back. This runs our draft model inside SGLang's runner
  (deploy/sglang/runner.py: RadixAttention, the DFLASH context-KV hooks with our per-layer input
  norm, the learned mask embedding); the DRELAY server log is scanned for which draft paths SGLang
  took (selector folded into the draft CUDA graph, fused KV materialisation disabled as intended).
  With a random drafter the acceptance statistics only show that the path runs, not draft quality.
Needs: `pip install -e . --no-deps` in the SGLang environment (the plugin's entry point), see
docs/sglang.md. Writes `sglang_check.json` under --out (default outputs/gpu).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

QWEN3_4B = dict(hidden=2560, vocab=151_936, layers=5, H=15, K=16)


def _timed(fn, *, warmup: int = 10, reps: int = 50) -> float:
    """Median milliseconds of fn() on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_kernels() -> dict:
    from drelay_model.drafter import DraftBlock
    from drelay_model.selectors import SelectionContext
    from drelay_model.selectors.drelay import DRelayConfig, DRelaySelector

    s = QWEN3_4B
    torch.manual_seed(0)
    embed = torch.randn(s["vocab"], s["hidden"], device="cuda", dtype=torch.bfloat16)
    feat = s["layers"] * s["hidden"]
    out = {}
    sels = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(1)
        sel = DRelaySelector(DRelayConfig(kernels=backend), embed_weight=embed, num_slots=s["H"], top_k=s["K"], feature_dim=feat)
        with torch.no_grad():
            for p in sel.residual_heads():  # a stand-in for a trained selector: REPAIRs happen
                p.copy_(torch.randn_like(p))
        sels[backend] = sel.to("cuda", torch.bfloat16).eval()
    for B in (1, 8, 32):
        g = torch.Generator(device="cuda").manual_seed(B)
        logq = torch.log_softmax(torch.randn(B, s["H"], s["vocab"], device="cuda", generator=g) * 2, -1)
        cand_logq, cand_ids = logq.topk(s["K"], dim=-1)
        block = DraftBlock(
            hidden=torch.randn(B, s["H"], s["hidden"], device="cuda", generator=g).bfloat16(),
            cand_ids=cand_ids,
            cand_logq=cand_logq,
        )
        n = DRelayConfig().history_len
        ctx = SelectionContext(
            anchor_ids=torch.randint(0, s["vocab"], (B,), device="cuda", generator=g),
            anchor_pos=torch.zeros(B, dtype=torch.long, device="cuda"),
            row_ids=torch.arange(B, device="cuda"),
            history=torch.randn(B, n, feat, device="cuda", generator=g).bfloat16(),
            history_mask=torch.ones(B, n, dtype=torch.bool, device="cuda"),
        )
        picks = {k: v.select(block, ctx).pool_index for k, v in sels.items()}
        row = {f"{k}_ms": round(_timed(lambda v=v: v.select(block, ctx)), 3) for k, v in sels.items()}
        row["same_paths"] = bool(torch.equal(picks["torch"], picks["triton"]))
        row["repairs"] = int(picks["torch"].ne(0).sum())
        out[f"B={B}"] = row
        print(f"kernels B={B}: {row}", flush=True)
    return out


def _random_qwen3_target(path: Path):
    """Save a random Qwen3-shaped target (no tokenizer: the servers run --skip-tokenizer-init) and
    return it as our TargetModel (built in memory: `load_target` wants a tokenizer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from drelay_model.target import TargetModel

    s = QWEN3_4B
    cfg = Qwen3Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=9728,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return TargetModel(model.float(), name="random-qwen3")


def _export_random_drafter(target, out: Path) -> None:
    from deploy.sglang.export import main as export_main
    from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
    from drelay_model.selectors import default_registry

    torch.manual_seed(0)
    # Feature layers 0..2 of 4: SGLang captures a layer's output before the next layer runs, so the
    # last layer (3) cannot be one.
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, target_layer_ids=(0, 1, 2)), target).eval()
    sel = default_registry().create("drelay", drafter=drafter).eval()
    extra = {f"selector.{k}": v for k, v in sel.state_dict().items()}
    ckpt = out.parent / "drafter_ckpt"
    save_drafter(drafter, ckpt, extra_tensors=extra, meta={"selector": {"name": "drelay", "config": sel.config.to_dict()}})
    assert export_main(["--format", "sglang", "--context-length", str(target.max_positions), str(ckpt), str(out)]) == 0


def _serve(args: list[str], port: int, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "SGLANG_EXTERNAL_MODEL_PACKAGE": "deploy.sglang.models",
        "SGLANG_PLUGINS": "drelay",
        "PYTHONPATH": str(REPO),
    }  # the same environment as deploy/serve/backends/sglang.py's server_env
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--mem-fraction-static",
        "0.3",
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log: {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"server did not come up in 600 s; log: {log}")


def _post(port: int, route: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _generate(port: int, prompts: list[list[int]]) -> list[dict]:
    return [
        _post(
            port, "/generate", {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}}
        )
        for p in prompts
    ]


LOG_MARKERS = {  # SGLang 0.5.23's log lines (tp rank 0) for the draft paths DRELAY should take
    "selector_in_draft_graph": "selector decode folded into the draft cuda graph",
    "fused_kv_disabled": "DFLASH fused KV materialization disabled",
}


def _log_flags(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return {name: marker in text for name, marker in LOG_MARKERS.items()}


def check_server(work: Path) -> dict:
    from importlib.metadata import entry_points

    if not any(ep.name == "drelay" for ep in entry_points(group="sglang.srt.plugins")):
        raise RuntimeError("the drelay plugin entry point is not installed: run `pip install -e . --no-deps` here first")
    target, draft = work / "target", work / "draft"
    _export_random_drafter(_random_qwen3_target(target), draft)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, QWEN3_4B["vocab"], (n,), generator=g).tolist() for n in (7, 31, 120)]
    result = {}
    for name, extra in {
        "ar": [],
        "drelay": [
            "--speculative-algorithm",
            "DRELAY",
            "--speculative-draft-model-path",
            str(draft),
            "--speculative-num-draft-tokens",
            "16",
        ],
    }.items():
        proc = _serve(["--model-path", str(target), *extra], 30000 + len(result), work / f"{name}.log")
        try:
            result[name] = _generate(30000 + len(result), prompts)
            if name == "drelay":
                try:
                    comp = _post(
                        30000 + len(result),
                        "/v1/completions",
                        {
                            "model": str(target),
                            "prompt": prompts[0],
                            "max_tokens": 32,
                            "temperature": 0,
                            "return_spec_tokens_details": True,
                        },
                    )
                    result["sglext"] = comp.get("sglext")
                except OSError as exc:
                    result["sglext"] = f"unavailable: {exc}"
        finally:
            proc.terminate()
            proc.wait(60)
    result["draft_paths"] = _log_flags(work / "drelay.log")
    same = [a["output_ids"] == d["output_ids"] for a, d in zip(result["ar"], result["drelay"])]
    meta = [
        {
            k: d["meta_info"].get(k)
            for k in ("spec_verify_ct", "spec_accept_length", "spec_correct_drafts_histogram", "spec_accept_rate")
        }
        for d in result["drelay"]
    ]
    print(
        f"server: greedy identical per prompt {same}; spec stats {meta}; sglext {result.get('sglext')}; "
        f"draft paths {result['draft_paths']}",
        flush=True,
    )
    return {"identical": same, "spec_meta": meta, "sglext": result.get("sglext"), "draft_paths": result["draft_paths"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("kernels", "server", "all"))
    ap.add_argument("--out", default=str(REPO / "outputs" / "gpu"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sglang_check.py: error: needs a CUDA device (this check runs on a GPU machine)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(0)}
    if args.what in ("kernels", "all"):
        report["kernels"] = check_kernels()
    if args.what in ("server", "all"):
        work = out / "sglang_work"  # target, export and server logs stay here for inspection
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            report["server"] = check_server(work)
        except Exception as exc:  # report plainly what failed; the server logs are in `work`
            report["server"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"server: FAILED {report['server']['error']}", flush=True)
    (out / "sglang_check.json").write_text(json.dumps(report, indent=2))
    ok = all(r["same_paths"] for r in report.get("kernels", {}).values()) and all(
        report.get("server", {}).get("identical", [True])
    )
    return 0 if ok and "error" not in report.get("server", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
