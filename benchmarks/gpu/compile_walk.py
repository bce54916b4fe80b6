"""Compile the decision-walk Triton kernel (drelay_model/kernels/walk.py) for a CUDA architecture
without a GPU and print its size: PTX lines, SASS instructions, registers, spills.

    python benchmarks/gpu/compile_walk.py [--arch 90] [--heads 2] [--head-dim 16] [--width 32]

Triton ships ptxas and cuobjdump, so the kernel compiles on a CPU machine with the installed Triton:
the compiled form each Triton makes of the same kernel can be compared before a GPU is lent (bf16
inputs, K + 1 ≤ 32 candidates, H = 15 slots). Compiling takes minutes on a busy CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from drelay_model.kernels.walk import _block, _walk_kernel  # noqa: E402

POINTERS = ("query", "pre", "rank0", "gate0", "ak", "av", "aq", "ck", "cv", "cq", "outw", "headw", "headb")


def compile_walk(arch: int, heads: int, head_dim: int, width: int) -> dict:
    sig = {f"{n}_ptr": "*bf16" for n in POINTERS}
    sig |= {"pick_ptr": "*i64", "gate_ptr": "*bf16", "rank_ptr": "*bf16", "K": "i32", "C": "i32"}
    sig |= {"scale": "fp32", "tie_tol": "fp32"}
    const = dict(H=15, NH=heads, DG=head_dim, K1P=32, HP=16, RP=_block(heads * head_dim), CP=_block(width), CONTRAST=True)
    sig |= {k: "constexpr" for k in const}
    kernel = triton.compile(ASTSource(fn=_walk_kernel, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32))
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "walk.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    res = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    return {
        "triton": triton.__version__,
        "arch": f"sm_{arch}",
        "ptx_lines": len(kernel.asm["ptx"].splitlines()),
        "sass_instructions": sum(bool(re.match(r"\s+/\*[0-9a-f]{4}\*/", line)) for line in sass.splitlines()),
        "registers": int(res.get("REG", 0)),
        "spill_bytes": int(res.get("LOCAL", 0)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="compile_walk.py", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: H100/H200)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--width", type=int, default=32, help="the compact width C")
    args = ap.parse_args(argv)
    print(compile_walk(args.arch, args.heads, args.head_dim, args.width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
