"""Shared fixtures for the model tests: tiny random targets, untrained drafters, a scripted selector."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding.cost_policy import RoundCosts, surface_batches
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import Selection, SelectionContext, Selector
from drelay_model.target import tiny_target

TINY_ARCHS = ("tiny-llama", "tiny-qwen3")


class ScriptedSelector(Selector):
    """Test-only selector that proposes the target's known continuation, corrupted at random slots.

    It ignores the pool on purpose: the engine must stay lossless for *any* path, and a path that is
    mostly right exercises every accepted length 0..H, which an untrained drafter never reaches.
    `reference[row]` is prompt + greedy continuation; the anchor sits at `anchor_pos`.
    """

    def __init__(self, reference: list[list[int]], *, error_rate: float = 0.15, seed: int = 0, vocab: int = 256):
        super().__init__()
        self.reference = reference
        self.error_rate = error_rate
        self.vocab = vocab
        self.seed = seed

    def select(self, block, ctx: SelectionContext) -> Selection:
        B, H, _ = block.cand_ids.shape
        path = torch.zeros(B, H, dtype=torch.long)
        for i, (row, pos) in enumerate(zip(ctx.row_ids.tolist(), ctx.anchor_pos.tolist())):
            # Corruption depends only on (seed, row, position): batched decoding and per-row replay
            # see the same paths.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + row * 10_007 + pos)
            path[i] = torch.randint(0, self.vocab, (H,), generator=gen)
            ref = torch.tensor(self.reference[row][pos + 1 : pos + 1 + H], dtype=torch.long)
            keep = torch.rand(len(ref), generator=gen) >= self.error_rate
            path[i, : len(ref)] = torch.where(keep, ref, path[i, : len(ref)])
        return Selection(pool_index=torch.zeros(B, H, dtype=torch.long), path_ids=path, length=torch.full((B,), H))


@pytest.fixture(scope="session", params=TINY_ARCHS)
def target(request):
    return tiny_target(request.param)


@pytest.fixture(scope="session")
def make_drafter():
    def build(target, seed: int = 0, cpu_kernels=None, **overrides) -> BlockDrafter:
        """An untrained drafter (the same weights for the same seed) with `cpu_kernels` (default: the target's)."""
        torch.manual_seed(seed)
        cfg = DrafterConfig.for_target(target, **{"num_layers": 1, **overrides})
        return BlockDrafter(cfg, target, cpu_kernels=cpu_kernels).eval()

    return build


@pytest.fixture(scope="session")
def scripted_selector():
    return ScriptedSelector


def _steep_batch_surface(H: int) -> RoundCosts:
    """A cost surface over batch sizes 1, 2, 4 where drafting pays for one row and not for four: each
    verified draft adds 0.1 ms to a round alone, 8 ms at two rows and 60 ms at four."""
    slope = {1: 0.1, 2: 8.0, 4: 60.0}
    batches = surface_batches(4)
    return RoundCosts(
        verify_ms=[[10.0 * b + slope[b] * (t - 1) for t in range(1, H + 2)] for b in batches],
        draft_slots_ms=[[0.5 * b] * H for b in batches], select_ms=0.1, batch_sizes=batches,
    )  # fmt: skip


@pytest.fixture(scope="session")
def steep_batch_surface():
    return _steep_batch_surface


def _run_arrivals(batcher, prompts, settings, arrivals, on_update) -> None:
    """Submit request i (it gets id i) at step arrivals[i] (ascending), stepping until all are done."""
    step, submitted = 0, 0
    while submitted < len(prompts) or not batcher.idle:
        while submitted < len(prompts) and arrivals[submitted] <= step:
            assert batcher.submit(prompts[submitted], settings[submitted], on_update) == submitted
            submitted += 1
        batcher.step()
        step += 1


@pytest.fixture(scope="session")
def run_arrivals():
    return _run_arrivals


def random_prompts(vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def prompts_of():
    return random_prompts


def _hf_greedy(target, prompt: list[int], max_new: int) -> list[int]:
    """The target's own greedy continuation from Hugging Face generate() (EOS included if hit)."""
    out = target.hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=list(target.eos_token_ids) or None,
    )[0, len(prompt) :].tolist()
    eos = set(target.eos_token_ids)
    return next((out[: i + 1] for i, t in enumerate(out) if t in eos), out)


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


# Small hyper-parameters per trainable selector, for fast tests on tiny drafters.
TINY_SELECTOR_CONFIGS = {
    "drelay": {"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 8},
    "dcoco": {"d": 16, "mlp": 16},
    "dflash2": {"rank": 8},
    "domino": {"d": 16},
    "dspark": {"rank": 8},
}


@pytest.fixture(scope="session")
def tiny_selector_config():
    return lambda name: dict(TINY_SELECTOR_CONFIGS.get(name, {}))


@pytest.fixture()
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine they lose a lot."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def make_engine(make_drafter):
    """make_engine(target, method, selector=None, config=None): an AR engine for "ar", else a fresh
    drafter (make_drafter) under `selector` or the registry's `method` built with `config`."""
    from drelay_model.decoding import SpeculativeEngine
    from drelay_model.selectors import default_registry

    def build(target, method, selector=None, config=None):
        if method == "ar":
            return SpeculativeEngine(target)
        drafter = make_drafter(target)
        return SpeculativeEngine(target, drafter, selector or default_registry().create(method, drafter=drafter, config=config))

    return build
