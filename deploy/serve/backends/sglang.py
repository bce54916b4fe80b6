"""`sglang` backend: an SGLang server subprocess running the DRelay algorithm (GPU hosts, the sglang
extra; the algorithm itself is registered by deploy/sglang's plugin).

The replica launches `python -m sglang.launch_server` on 127.0.0.1, waits for its /health, and
forwards each request to SGLang's native `/generate` with token ids (the app renders prompts with the
same tokenizer for both backends) and streaming on. SGLang's `meta_info` carries the speculative
statistics (`spec_verify_ct`, `spec_accept_histogram`, `completion_tokens`); they are kept and
returned as `sglext`, which Ray Serve's stock SGLang server drops.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

from deploy.serve.backends.base import Backend, GenChunk, GenRequest, Overloaded, SpecStats
from deploy.serve.config import LimitsSection, SGLangSection
from drelay_model.errors import DRelayError


def launch_command(cfg: SGLangSection) -> list[str]:
    """The SGLang server command line for a config (also what docs/serving.md shows)."""
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--speculative-algorithm", cfg.algorithm,
        "--speculative-draft-model-path", cfg.draft_model_path,
        "--speculative-num-draft-tokens", str(cfg.num_draft_tokens),
        "--host", "127.0.0.1", "--port", str(cfg.port),
        "--mem-fraction-static", str(cfg.mem_fraction_static),
        *cfg.extra_args,
    ]


def sampling_params(request: GenRequest) -> dict:
    s = request.settings
    return {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1, "sampling_seed": s.seed}


def chunk_from_event(event: dict, sent: int) -> tuple[GenChunk, int]:
    """One streamed `/generate` event (cumulative `output_ids`) → the new ids since `sent`."""
    ids = event.get("output_ids") or []
    meta = event.get("meta_info") or {}
    finish = (meta.get("finish_reason") or {}).get("type")
    spec = None
    if finish is not None:
        finish = "length" if finish == "length" else "stop"
        spec = SpecStats(verify_ct=int(meta.get("spec_verify_ct") or 0),
                         accept_histogram=list(meta.get("spec_accept_histogram") or []),
                         completion_tokens=int(meta.get("completion_tokens") or len(ids)))
    return GenChunk(token_ids=ids[sent:], finish_reason=finish, spec=spec), len(ids)


class SGLangBackend(Backend):
    def __init__(self, cfg: SGLangSection, limits: LimitsSection) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.method = cfg, cfg.algorithm.lower()
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.max_waiting = limits.max_waiting
        self._inflight = 0
        self.proc = subprocess.Popen(launch_command(cfg))
        self._wait_healthy()
        info = self._get("/get_model_info")
        self.context_window = int(info.get("max_context_length") or info.get("context_length") or 0) or 10**9

    def _get(self, path: str) -> dict:
        import requests

        return requests.get(self.url + path, timeout=10).json()

    def _wait_healthy(self) -> None:
        import requests

        deadline = time.time() + self.cfg.startup_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise DRelayError(f"the SGLang server exited with status {self.proc.returncode} during startup")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.shutdown()
        raise DRelayError(f"sglang.startup_timeout_s: the SGLang server was not healthy after {self.cfg.startup_timeout_s} s")

    def load(self) -> dict[str, int]:
        return {"running": self._inflight, "waiting": 0}

    def ready(self) -> bool:
        return self.proc.poll() is None

    def check_prompt(self, prompt_ids: list[int], max_tokens: int) -> None:
        if len(prompt_ids) + max_tokens > self.context_window:
            raise DRelayError(f"prompt has {len(prompt_ids)} tokens; with max_tokens={max_tokens} it exceeds the context window ({self.context_window})")

    def submit(self, request: GenRequest) -> AsyncIterator[GenChunk]:
        self.check_prompt(request.prompt_ids, request.settings.max_new_tokens)
        if self._inflight >= self.max_waiting + 1024:
            raise Overloaded(f"replica saturated: {self._inflight} requests in flight")
        return self._stream(request)

    async def _stream(self, request: GenRequest) -> AsyncIterator[GenChunk]:
        import aiohttp

        body = {"input_ids": request.prompt_ids, "sampling_params": sampling_params(request), "stream": True}
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
                    if chunk.finish_reason is None and request.settings.stop is not None and chunk.token_ids and request.settings.stop(ids):
                        # A stop string completed: end here (closing the stream aborts the request in SGLang).
                        yield GenChunk(token_ids=chunk.token_ids, finish_reason="stop",
                                       spec=SpecStats(verify_ct=0, completion_tokens=len(ids)))
                        return
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
        finally:
            self._inflight -= 1

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
