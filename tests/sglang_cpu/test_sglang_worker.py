"""`DRelayWorker` against SGLang 0.5.23's own code on CPU: how far its construction gets (the
scheduler's path, stopping where SGLang needs a CUDA device), and its ring fed exactly as
`DFlashWorkerV2.forward_batch_generation` feeds the draft KV: prefills (chunked ones included),
verify rounds, a reused slot; SGLang's own materialisation code runs underneath into a real KV pool."""

from __future__ import annotations

import contextlib
import socket
import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytestmark = pytest.mark.sglang_cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stops_at_cuda_device(exc: BaseException) -> bool:
    """The failure is SGLang's ModelRunner selecting its CUDA device (no NVIDIA driver here)."""
    frames = [(f.filename.rsplit("/", 2)[-1], f.name) for f in traceback.extract_tb(exc.__traceback__)]
    return "NVIDIA driver" in str(exc) and ("model_runner.py", "__init__") in frames and frames[-1][1] == "_lazy_init"


@pytest.fixture()
def tp_groups(published):
    """SGLang's world and model-parallel groups for one rank, on gloo: what the target's ModelRunner
    builds (on NCCL) right after selecting its CUDA device, which it cannot do here."""
    from sglang.srt.distributed import parallel_state as ps

    ps.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{_free_port()}"
    )
    ps.initialize_model_parallel(backend="gloo")
    yield
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def test_worker_construction_runs_sglangs_code_until_the_cuda_device(published, tp_groups, drelay_registered, dirs):
    """The scheduler builds the target TpModelWorker, then `create_worker(args)(…, target_worker)`.
    On CPU the target's ModelRunner stops at `torch.cuda.set_device`. Given the parallel groups and
    the target config that worker would hold, DRelayWorker's construction (DFlashWorkerV2.__init__)
    runs into `build_draft_tp_worker`: the draft TpModelWorker builds the draft's ModelConfig at the
    target's context length, and its ModelRunner stops at the same `set_device`. The worker's own
    lines after `super().__init__` (binding the selector to the target's embedding) need a GPU."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state

    cls = drelay_registered.create_worker(published)
    assert cls.__name__ == "DRelayWorker"
    with pytest.raises(RuntimeError) as target_exc:
        TpModelWorker(server_args=published, gpu_id=0, nccl_port=_free_port())
    assert _stops_at_cuda_device(target_exc.value), target_exc.value

    target_config = ModelConfig.from_server_args(published)
    aux = SimpleNamespace(draft_model_config=None)  # filled as SGLang fills it for DFLASH-family targets
    spec_aux_hidden_state._resolve_dflash_aux_hidden_state(
        config=aux, server_args=published, model_config=target_config, spec_algorithm=drelay_registered, is_draft_worker=False
    )
    runner = SimpleNamespace(model_config=target_config, spec_aux_config=aux, spec_algorithm=drelay_registered)
    target_worker = SimpleNamespace(model_runner=runner, device="cuda")  # what a built target worker exposes
    with pytest.raises(RuntimeError) as draft_exc:
        cls(server_args=published, gpu_id=0, nccl_port=_free_port(), target_worker=target_worker)
    assert _stops_at_cuda_device(draft_exc.value), draft_exc.value
    names = [f.name for f in traceback.extract_tb(draft_exc.value.__traceback__)]
    assert names.index("build_draft_tp_worker") < names.index("_init_model_runner")


@pytest.fixture()
def worker(published, drelay_registered, dirs):
    """A DRelayWorker holding what DFlashWorkerV2.__init__ sets for the methods under test: the
    draft model as SGLang's DefaultModelLoader builds it (bf16), SGLang's request pool and MHA KV
    pool on CPU, the sequential (unfused) materialisation path. Built without __init__, which needs
    CUDA (test above)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from deploy.sglang.ring_feed import PrefillTracker

    config = ModelConfig.from_server_args(published, model_path=str(dirs["draft"]), is_draft_model=True, context_length=1024)
    model = DefaultModelLoader(LoadConfig()).load_model(model_config=config, device_config=DeviceConfig("cpu"))
    model.bind_selector(dirs["embed"].to(torch.bfloat16))
    attn = model.layers[0].self_attn
    kv = MHATokenToKVPool(
        size=512, page_size=1, dtype=torch.bfloat16, head_num=attn.num_kv_heads, head_dim=attn.head_dim,
        layer_num=len(model.layers), device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    pool = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
    w = object.__new__(drelay_registered.create_worker(published))
    w.__dict__.update(
        device="cpu", model_runner=SimpleNamespace(device="cpu", req_to_token_pool=pool), draft_model=model,
        draft_model_runner=SimpleNamespace(token_to_kv_pool=kv, kv_index_translator=None), lilicorr=None,
        _use_fused_kv_materialize=False, _fused_kv_helper=None, draft_parallel_layout=SimpleNamespace(tp_group=None),
        use_compact_draft_cache=False, _draft_worker=SimpleNamespace(alloc_memory_pool=lambda **_: None),
        _target_worker=SimpleNamespace(), _drelay_tracker=PrefillTracker(), _drelay_feed=None,
    )  # fmt: skip
    w.alloc_memory_pool(req_to_token_pool=pool)
    return w


class Watch(TorchDispatchMode):
    """Counts device→host reads (`aten._local_scalar_dense`: `int(t)`, `.item()`) and the most rows
    of any new tensor `width` wide made inside the block (in-place writes into the ring and the
    features SGLang passes in are not new)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.syncs, self.rows = width, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and t.ndim
                and t.shape[-1] == self.width
                and t.untyped_storage().data_ptr() not in given
            ):
                self.rows = max(self.rows, t.numel() // self.width)
        return out


def _req(rid: str, slot: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", [1, 2, 3], SamplingParams())
    req.kv.req_pool_idx = slot
    return req


def _batch(mode, reqs, prefix_lens=None, extend_lens=None):
    """The ScheduleBatch fields the worker reads (the real batch needs the scheduler's caches)."""
    slots = torch.tensor([r.kv.req_pool_idx for r in reqs])
    return SimpleNamespace(forward_mode=mode, is_extend_in_batch=False, reqs=reqs, req_pool_indices=slots,
                           prefix_lens=prefix_lens, extend_lens=extend_lens)  # fmt: skip


def test_ring_is_fed_by_prefills_chunked_prefills_and_verifies_as_sglang_calls(worker):
    """Request a's 17-token prompt arrives as chunks of 12 and 5 (the second with prefix_len 12:
    appended, not reset), b's in one; three verify rounds; then c reuses b's slot after a radix
    hit (reset). The ring reads what the engine's VerifiedHistory holds for the same commits, and
    SGLang's own code wrote the draft KV through our hooks."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from drelay_model.decoding.history import VerifiedHistory

    g = torch.Generator().manual_seed(0)
    ring = worker.selector.history
    N, Fd = ring.size, ring.buf.shape[-1]
    engine = {s: VerifiedHistory(1, N, Fd, dtype=torch.bfloat16) for s in (1, 3)}
    a, b = _req("a", 1), _req("b", 3)
    loc = iter(range(1, 512))

    def prefill(reqs, prefix_lens, extend_lens, feats, watch=contextlib.nullcontext()):
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)])
        cache_loc = torch.tensor([next(loc) for _ in range(sum(extend_lens))])
        batch = _batch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens)
        with watch:  # what the worker does with one prefill
            worker.stage_batch(batch)
            worker._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=feats,
                cache_loc=cache_loc,
                positions=positions,
                extend_lens=torch.tensor(extend_lens, dtype=torch.int32),
            )
        start = 0
        for r, n in zip(reqs, extend_lens):
            engine[r.kv.req_pool_idx].push(feats[None, start : start + n], torch.tensor([n]))
            start += n
        return feats[: sum(extend_lens)], positions, cache_loc

    def check():
        got, mask = ring.read(torch.tensor([1, 3]))
        for i, slot in enumerate((1, 3)):
            assert torch.equal(got[i], engine[slot].feats[0]) and torch.equal(mask[i], engine[slot].mask()[0]), slot

    first = torch.randn(12 + 5 + 2, Fd, generator=g).to(torch.bfloat16)  # + 2 alignment-padding rows, as SGLang may pass
    watch = Watch(width=Fd)
    feats, positions, cache_loc = prefill([a, b], [0, 0], [12, 5], first, watch)
    assert watch.syncs == 0 and watch.rows <= 8 + 5  # each request's last N rows at most: no [bs, 12, L·D]
    ctx_k, _ = worker.draft_model.context_kv(feats, positions)[0]
    assert torch.equal(worker.draft_model_runner.token_to_kv_pool.get_key_buffer(0)[cache_loc], ctx_k)
    prefill([a], [12], [5], torch.randn(5, Fd, generator=g).to(torch.bfloat16))  # chunked prefill: the continuation appends
    check()  # (a reset would have dropped chunk 1's last 3 rows from a's window of 8)
    S, reqs = worker.draft_model.block_size, [a, b]
    for _ in range(3):
        worker.stage_batch(_batch(ForwardMode.DECODE, reqs))
        dense = torch.randn(2 * S, Fd, generator=g).to(torch.bfloat16)
        commit = torch.randint(1, S + 1, (2,), generator=g, dtype=torch.int32)
        cache_loc = torch.tensor([next(loc) for _ in range(2 * S)])
        worker._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=dense, cache_loc=cache_loc, cache_loc_2d=cache_loc.view(2, S),
            positions=torch.arange(2 * S) + 40, commit_lens=commit,
        )  # fmt: skip
        for i, r in enumerate(reqs):
            engine[r.kv.req_pool_idx].push(dense.view(2, S, Fd)[i : i + 1], commit[i : i + 1].long())
    engine[3] = VerifiedHistory(1, N, Fd, dtype=torch.bfloat16)
    prefill(
        [_req("c", 3)], [6], [3], torch.randn(3, Fd, generator=g).to(torch.bfloat16)
    )  # a new request in b's slot, 6 tokens from the radix cache
    check()
