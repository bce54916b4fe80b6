"""Step `lossless`: greedy speculative decoding keeps the target's own greedy output, on a random
target with Qwen3's vocabulary (151,936), for AR and every registry selector (untrained drafter).

    float32   every method's tokens equal Hugging Face `generate(do_sample=False)`, token for token;
    bfloat16  every token is the bf16 target's argmax up to a tie (logit within BF16_TIE of the
              max under one teacher-forced forward), since verify(16) and decode(1) round
              differently in bf16; how many rows equal the AR engine's exactly is reported too.
"""

from __future__ import annotations

import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import default_registry
from drelay_model.target import load_target

DESCRIPTION = "greedy lossless, fp32 (= HF generate) and bf16 (argmax up to ties), AR + every selector, Qwen3 vocabulary"
NEEDS = ("cuda",)
BF16_TIE = 0.15  # logit units: the bf16 rounding of one logit at these scales is well below it
SHAPES = {
    "full": dict(
        spec="tiny-qwen3:vocab=151936,hidden=256,layers=4,heads=4,kv_heads=2", new_tokens=48, prompts=(5, 9, 3, 40, 17, 2, 64, 11)
    ),
    "tiny": dict(spec="tiny-qwen3:vocab=512,hidden=64,layers=2,heads=4,kv_heads=2", new_tokens=8, prompts=(5, 9)),
}


def _engine(target, method: str) -> SpeculativeEngine:
    if method == "ar":
        return SpeculativeEngine(target)
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1), target).to(device=target.device, dtype=target.dtype)
    selector = default_registry().create(method, drafter=drafter).to(device=target.device, dtype=target.dtype)
    return SpeculativeEngine(target, drafter, selector)


def _hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    return target.hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()


def _argmax_up_to_ties(target, prompt: list[int], out: list[int]) -> bool:
    with torch.inference_mode():
        logits = target.hf(torch.tensor([prompt + out], device=target.device)).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(out, device=target.device)[:, None])[:, 0]
    return bool((chosen >= logits.max(dim=1).values - BF16_TIE).all())


def run(device: str, scale: str) -> dict:
    s = SHAPES[scale]
    methods = ["ar", *default_registry().names()]
    g = torch.Generator().manual_seed(1)
    report: dict = {"target": s["spec"], "new_tokens": s["new_tokens"], "prompts": len(s["prompts"]), "methods": {}}
    ok = True
    for dtype in ("float32", "bfloat16"):
        target = load_target(s["spec"], device=device, dtype=dtype)
        prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in s["prompts"]]
        cfg = GenerationConfig(max_new_tokens=s["new_tokens"])
        ar = SpeculativeEngine(target).generate(prompts, cfg).tokens
        reference = [_hf_greedy(target, p, s["new_tokens"]) for p in prompts] if dtype == "float32" else ar
        for method in methods:
            res = _engine(target, method).generate(prompts, cfg)
            if dtype == "float32":
                lossless = res.tokens == reference
            else:
                lossless = all(_argmax_up_to_ties(target, p, o) for p, o in zip(prompts, res.tokens))
            same_as_ar = sum(a == b for a, b in zip(res.tokens, ar))
            report["methods"][f"{method}/{dtype}"] = {
                "lossless": lossless,
                "rows_equal_to_ar": f"{same_as_ar}/{len(prompts)}",
                "tau": round(res.stats.tau, 3),
            }
            ok &= lossless
    report["ok"] = ok
    return report
