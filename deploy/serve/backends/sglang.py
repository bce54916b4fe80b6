"""`sglang` backend: an SGLang server subprocess running the DRelay algorithm (GPU hosts; the
algorithm itself is registered by deploy/sglang's plugin).

SGLang runs from its own environment (`sglang.python`: a venv, or the Python of the container image a
KubeRay worker pod runs; it holds sglang and this project installed `--no-deps` for the plugin's entry
point): its torch/transformers pins cannot share this project's environment, where the replica runs.
At start the replica resolves the draft (`models:/name@alias` → exported to SGLang's format once per
version, deploy/sglang/draft_source.py), takes the context length (config, else the target's
`max_position_embeddings`; SGLang's `/get_model_info` carries none), and launches
`<python> -m sglang.launch_server` on 127.0.0.1 with the plugin's environment (`SGLANG_PLUGINS`,
`SGLANG_EXTERNAL_MODEL_PACKAGE`, this checkout on `PYTHONPATH`) and the replica's GPUs; it waits for
/health, and forwards each request to SGLang's native `/generate` with token ids (the app renders
prompts with the same tokenizer for both backends) and streaming on. SGLang's `meta_info` carries
the speculative statistics (deploy/sglang/stats.py: `spec_verify_ct`, `spec_correct_drafts_histogram`,
…, and `completion_tokens`); they are kept and returned as `sglext`, which Ray Serve's stock SGLang
server drops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

from deploy.serve.backends.base import Backend, GenChunk, GenRequest, Overloaded, SpecStats
from deploy.serve.config import LimitsSection, SGLangSection
from deploy.sglang.stats import spec_fields
from drelay_model.decoding.logprobs import TokenLogprob
from drelay_model.errors import DRelayError


REPO_ROOT = Path(__file__).resolve().parents[3]
PYTHON_ENV = "DRELAY_SGLANG_PYTHON"


def _repo_path(path: str) -> str:
    """Config paths are relative to the repository root (replicas may run in another directory)."""
    return path if path.startswith("models:/") or Path(path).is_absolute() or Path(path).exists() else str(REPO_ROOT / path)


def sglang_python(cfg: SGLangSection) -> str:
    """SGLang's interpreter: `sglang.python`, else $DRELAY_SGLANG_PYTHON, else <repo>/.venv-sglang;
    it must hold sglang and the `drelay` plugin entry point (one line otherwise)."""
    python = _repo_path(cfg.python or os.environ.get(PYTHON_ENV) or ".venv-sglang/bin/python")
    probe = (
        "import importlib.metadata as m; print(m.version('sglang')); "
        "print(any(e.name == 'drelay' for e in m.entry_points(group='sglang.srt.plugins')))"
    )
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DRelayError(
            f"sglang.python: cannot run '{python}' ({exc}); name SGLang's interpreter (or set {PYTHON_ENV})"
        ) from None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2:
        raise DRelayError(f"sglang.python: '{python}' has no sglang installed (pip install sglang there, docs/sglang.md)")
    if lines[1] != "True":
        raise DRelayError(f"sglang.python: '{python}' lacks the DRelay plugin: pip install --no-deps -e {REPO_ROOT} there")
    return python


def launch_command(cfg: SGLangSection, *, python: str, draft: str, context_length: int) -> list[str]:
    """The SGLang server command line (token ids in, token ids out: no tokenizer in the server)."""
    return [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model_path,
        "--device",
        "cuda",
        "--context-length",
        str(context_length),
        "--skip-tokenizer-init",
        "--speculative-algorithm",
        cfg.algorithm,
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-draft-tokens",
        str(cfg.num_draft_tokens),
        "--speculative-eagle-topk",  # one path; said up front so Blackwell's backend default is DFLASH's
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(cfg.port),
        "--mem-fraction-static",
        str(cfg.mem_fraction_static),
        *cfg.extra_args,
    ]


def server_env(base: dict[str, str], *, gpu_ids: list[str]) -> dict[str, str]:
    """The SGLang server's environment: the DRelay plugin whitelisted, our draft-model package
    registered from this checkout (first on PYTHONPATH), and the replica's GPUs visible (Ray sets
    CUDA_VISIBLE_DEVICES for the actor; it is passed on explicitly). No GPU is one line: the replica
    needs `num_gpus` ≥ 1."""
    if not gpu_ids:
        raise DRelayError(
            "num_gpus: the sglang backend needs at least one GPU per replica (set num_gpus ≥ 1 in the serve config)"
        )
    plugins = [p for p in base.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    paths = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        **base,
        "SGLANG_PLUGINS": ",".join(dict.fromkeys([*plugins, "drelay"])),
        "SGLANG_EXTERNAL_MODEL_PACKAGE": "deploy.sglang.models",
        "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",  # logprobs of the raw distribution (as the engine backend)
        "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(REPO_ROOT), *paths])),
        "CUDA_VISIBLE_DEVICES": ",".join(gpu_ids),
    }


def _replica_gpu_ids() -> list[str]:
    """The GPUs Ray gave this replica (its CUDA_VISIBLE_DEVICES outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return [str(g) for g in ray.get_gpu_ids()]
    except ImportError:
        pass
    return [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]


def context_window(model_path: str) -> int:
    """The target's context length: `max_position_embeddings` of its config (what SGLang serves)."""
    from transformers import AutoConfig

    n = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    if not n:
        raise DRelayError(f"sglang.model_path: '{model_path}' config has no max_position_embeddings (the context length)")
    return int(n)


def sampling_params(request: GenRequest) -> dict:
    s = request.settings
    return {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "sampling_seed": s.seed,
    }


def request_body(request: GenRequest) -> dict:
    """SGLang's `/generate` body: token ids, sampling, streaming; with `return_logprob` and
    `top_logprobs_num` when the request asked for log-probabilities (output tokens only, as SGLang's
    own OpenAI server asks them)."""
    body = {"input_ids": request.prompt_ids, "sampling_params": sampling_params(request), "stream": True}
    if request.logprobs is not None:
        body |= {"return_logprob": True, "top_logprobs_num": request.logprobs, "logprob_start_len": -1}
    return body


def _logprobs(meta: dict, sent: int, n: int) -> list[TokenLogprob] | None:
    """The new tokens' entries from `meta_info`'s cumulative `output_token_logprobs`
    [(logprob, id, text)] and `output_top_logprobs` [[(logprob, id, text), …] | None]."""
    if "output_token_logprobs" not in meta:
        return None
    chosen = (meta.get("output_token_logprobs") or [])[sent : sent + n]
    tops = (meta.get("output_top_logprobs") or [])[sent : sent + n]
    tops = [*tops, *[None] * (len(chosen) - len(tops))]
    return [
        TokenLogprob(int(c[1]), float(c[0]), tuple((int(t[1]), float(t[0])) for t in (top or []))) for c, top in zip(chosen, tops)
    ]


def chunk_from_event(event: dict, sent: int) -> tuple[GenChunk, int]:
    """One streamed `/generate` event (cumulative `output_ids`) → the new ids since `sent`."""
    ids = event.get("output_ids") or []
    meta = event.get("meta_info") or {}
    logprobs = _logprobs(meta, sent, len(ids) - sent)
    finish = (meta.get("finish_reason") or {}).get("type")
    spec = None
    if finish is not None:
        finish = "length" if finish == "length" else "stop"
        stats = spec_fields(meta)
        spec = SpecStats(
            verify_ct=stats["verify_ct"],
            accept_histogram=stats["accept_histogram"],
            completion_tokens=int(meta.get("completion_tokens") or len(ids)),
        )
    return GenChunk(token_ids=ids[sent:], finish_reason=finish, spec=spec, logprobs=logprobs), len(ids)


class SGLangBackend(Backend):
    def __init__(self, cfg: SGLangSection, limits: LimitsSection) -> None:
        from deploy.serve.backends.engine import load_tokenizer
        from deploy.sglang.draft_source import resolve_draft

        self.cfg, self.method = cfg, cfg.algorithm.lower()
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.max_waiting = limits.max_waiting
        self._inflight = 0
        python = sglang_python(cfg)
        self.context_window = cfg.context_length or context_window(cfg.model_path)
        self.draft = resolve_draft(_repo_path(cfg.draft_model_path), context_length=self.context_window, dtype=cfg.draft_dtype)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model_path)
        cmd = launch_command(cfg, python=python, draft=str(self.draft), context_length=self.context_window)
        env = server_env(dict(os.environ), gpu_ids=_replica_gpu_ids())
        self._log = open(cfg.log_file, "ab") if cfg.log_file else None  # noqa: SIM115 - closed in shutdown
        # Its own process group: SGLang's scheduler and detokenizer processes end with it (shutdown).
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT if self._log else None, start_new_session=True
        )
        self._wait_healthy()

    def _get(self, path: str) -> dict:
        import requests

        return requests.get(self.url + path, timeout=10).json()

    def _wait_healthy(self) -> None:
        import requests

        deadline = time.time() + self.cfg.startup_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.shutdown()
                raise DRelayError(
                    f"the SGLang server exited with status {self.proc.returncode} during startup{self._last_error()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.shutdown()
        raise DRelayError(f"sglang.startup_timeout_s: the SGLang server was not healthy after {self.cfg.startup_timeout_s} s")

    def _last_error(self) -> str:
        """': <the log's last error line>' when the server writes to a log file."""
        if not self.cfg.log_file:
            return " (see the replica's log)"
        lines = Path(self.cfg.log_file).read_text(errors="replace").splitlines()
        errors = [line.strip() for line in lines if "Error" in line or "error:" in line]
        return f": {errors[-1][:300]}" if errors else f" (see {self.cfg.log_file})"

    def load(self) -> dict[str, int]:
        return {"running": self._inflight, "waiting": 0}

    def ready(self) -> bool:
        return self.proc.poll() is None

    def check_prompt(self, prompt_ids: list[int], max_tokens: int) -> None:
        if len(prompt_ids) + max_tokens > self.context_window:
            raise DRelayError(
                f"prompt has {len(prompt_ids)} tokens; with max_tokens={max_tokens} it exceeds the context window ({self.context_window})"
            )

    def submit(self, request: GenRequest) -> AsyncIterator[GenChunk]:
        self.check_prompt(request.prompt_ids, request.settings.max_new_tokens)
        if self._inflight >= self.max_waiting + 1024:
            raise Overloaded(f"replica saturated: {self._inflight} requests in flight")
        return self._stream(request)

    async def _stream(self, request: GenRequest) -> AsyncIterator[GenChunk]:
        import aiohttp

        body = request_body(request)
        self._inflight += 1
        try:
            async with aiohttp.ClientSession() as session, session.post(self.url + "/generate", json=body) as resp:
                if resp.status != 200:
                    raise DRelayError(f"SGLang answered {resp.status}: {(await resp.text())[:200]}")
                sent, ids = 0, []
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk, sent = chunk_from_event(json.loads(line[5:]), sent)
                    ids += chunk.token_ids
                    if (
                        chunk.finish_reason is None
                        and request.settings.stop is not None
                        and chunk.token_ids
                        and request.settings.stop(ids)
                    ):
                        # A stop string completed: end here (closing the stream aborts the request in SGLang).
                        yield GenChunk(
                            token_ids=chunk.token_ids,
                            finish_reason="stop",
                            spec=SpecStats(verify_ct=0, completion_tokens=len(ids)),
                            logprobs=chunk.logprobs,
                        )
                        return
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
        finally:
            self._inflight -= 1

    def shutdown(self) -> None:
        """End the server's process group (the server, its scheduler and detokenizer), by its id:
        SIGTERM, 30 s, then SIGKILL for anything left in the group; returns once the group is gone
        (or after 10 s more)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break  # nothing left in the group
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.killpg(self.proc.pid, 0)  # signal 0: does any process of the group remain?
            except ProcessLookupError:
                break
            time.sleep(0.2)
        if self._log is not None:
            self._log.close()
