"""The DRELAY plugin against SGLang 0.5.23's own code: loading, registration, argument handling and
every question SGLang's source asks of a speculative algorithm (found by parsing that source)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang_cpu

# Receivers that hold a speculative algorithm in SGLang's source (`self.spec_algorithm.is_dflash()`,
# `algo.handle_server_args(...)`, `SpeculativeAlgorithm.from_string(x).need_topk()`, …).
_RECEIVER = re.compile(r"(spec_alg\w*|speculative_algo\w*|\balgo|\balgorithm|\bspec|from_string\(.*\))$")


def called_spec_methods() -> dict[str, str]:
    """{method: one call site} for every method of SpeculativeAlgorithm / CustomSpecAlgo that
    SGLang's installed source calls on an algorithm object (including the classes' own `self.`
    calls)."""
    import sglang
    from sglang.srt.speculative import spec_info, spec_registry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    methods = {
        n for cls in (SpeculativeAlgorithm, CustomSpecAlgo) for n, v in vars(cls).items() if callable(v) and not n.startswith("_")
    } - {"register", "from_string"}
    own = {Path(spec_info.__file__), Path(spec_registry.__file__)}
    found: dict[str, str] = {}
    for path in sorted((Path(sglang.__file__).parent / "srt").rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
                receiver = ast.unparse(node.func.value)
                if _RECEIVER.search(receiver) or (receiver == "self" and path in own):
                    found.setdefault(node.func.attr, f"{path.name}:{node.lineno}")
    return found


def test_plugin_loads_through_load_plugins(drelay_registered):
    from importlib.metadata import entry_points

    assert any(
        ep.name == "drelay" and ep.value == "deploy.sglang.plugin:register" for ep in entry_points(group="sglang.srt.plugins")
    )
    assert type(drelay_registered).__name__ == "DRelaySpecAlgo" and drelay_registered.name == "DRELAY"
    assert drelay_registered.supports_overlap


def _call_args(name: str, server_args):
    """Arguments for the methods that take some (a discovered method missing here fails the test)."""
    return {
        "get_num_tokens_per_req_for_target_verify": [(16, False), (16, True)],
        "resolve_max_speculative_num_draft_tokens": [(server_args,)],
    }.get(name)


def test_every_method_sglang_calls_answers_as_dflash(drelay_registered, dirs):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    dflash = SpeculativeAlgorithm.DFLASH
    calls = called_spec_methods()
    assert {"handle_server_args", "need_topk", "carries_draft_hidden_states", "create_future_map", "is_dflash_family"} <= set(
        calls
    )
    missing = sorted(n for n in calls if not callable(getattr(drelay_registered, n, None)))
    assert not missing, f"SGLang calls these on an algorithm, DRELAY lacks them: {[(n, calls[n]) for n in missing]}"
    own = {"create_worker", "handle_server_args", "create_future_map", "build_disagg_draft_input"}  # checked below / elsewhere
    server_args = _server_args(dirs, "DRELAY")
    for name in sorted(set(calls) - own):
        params = [p for p in inspect.signature(getattr(dflash, name)).parameters.values() if p.default is p.empty]
        arg_sets = [()] if not params else _call_args(name, server_args)
        assert arg_sets is not None, f"{name} ({calls[name]}) takes arguments: add them to _call_args"
        for args in arg_sets:
            assert getattr(drelay_registered, name)(*args) == getattr(dflash, name)(*args), f"{name}{args} ({calls[name]})"


def test_future_map_holds_drelay_and_asks_dflash_questions(drelay_registered):
    import torch
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    fmap = drelay_registered.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=True)
    assert isinstance(fmap, FutureMap) and fmap.spec_algo is drelay_registered


def _server_args(dirs, algorithm: str):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(dirs["target"]),
        speculative_algorithm=algorithm,
        device="cuda",
        random_seed=0,
        speculative_draft_model_path=str(dirs["draft"]),
        speculative_num_draft_tokens=16,
        # DRELAY's documented flags say top-k 1 (DFLASH's handler derives it, too late for the
        # default attention backend, which reads it by the algorithm's name on Blackwell).
        speculative_eagle_topk=1 if algorithm == "DRELAY" else None,
        skip_tokenizer_init=True,
    )


@pytest.mark.parametrize("platform", [{}, {"is_sm100": True, "is_sm100_or_sm110": True}], ids=["this-machine", "blackwell"])
def test_server_args_resolve_as_dflash(drelay_registered, dirs, platform):
    """The documented flags pass SGLang's own argument handling and end with DFLASH's derived fields
    (device `cuda`: DFLASH's handler refuses the CPU; resolution itself needs no GPU), on a Blackwell
    (SM100) machine too, where SGLang picks DFLASH's draft attention backend by the algorithm's name:
    DRELAY's handler is DFLASH's, so it gets the same backend."""
    from sglang.srt.runtime_context import override_platform

    resolved = {}
    for algorithm in ("DFLASH", "DRELAY"):
        args = _server_args(dirs, algorithm)
        with override_platform(**platform):
            args.resolve_once()
        resolved[algorithm] = args.resolved_dict()
    diff = {k: (v, resolved["DRELAY"][k]) for k, v in resolved["DFLASH"].items() if v != resolved["DRELAY"][k]}
    assert diff == {"speculative_algorithm": ("DFLASH", "DRELAY")}
    drelay = resolved["DRELAY"]
    assert (drelay["speculative_num_steps"], drelay["speculative_eagle_topk"], drelay["max_running_requests"]) == (1, 1, 48)
    assert drelay["speculative_draft_attention_backend"] is not None


def test_validator_rejects_missing_draft_with_one_line(drelay_registered, dirs):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(dirs["target"]), speculative_algorithm="DRELAY", device="cuda", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        args.resolve_once()


def test_factory_gives_a_worker_that_waits_for_the_request_pool(drelay_registered, dirs):
    """SGLang's create_worker (overlap on) returns our DFlashWorkerV2 subclass. SGLang builds the
    worker before the memory pools, when max_running_requests may still be unset: the worker's
    constructor reads no such value and installs the seam in alloc_memory_pool instead."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    args = _server_args(dirs, "DRELAY")
    args.resolve_once()
    worker = drelay_registered.create_worker(args)
    assert issubclass(worker, DFlashWorkerV2) and worker.__name__ == "DRelayWorker"
    assert "max_running_requests" not in worker.__init__.__code__.co_names
    assert "install_selector_seam" in worker.alloc_memory_pool.__code__.co_names
