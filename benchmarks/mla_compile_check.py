"""CPU, no GPU needed: compile the MLA decode kernel's tiles for an NVIDIA target (default
sm_90, the H200) with Triton and its bundled ptxas, and print per tile the shared memory per
block, the MMA instructions used (wgmma / mma.sync), the cp.async count and ptxas's register and
spill report. A tile over 227 KiB of shared memory fails at launch on sm_90; spills cost
bandwidth. Used to pick the candidates of ``benchmarks/gpu_mla.py --parts kernel``.

Usage (repo root):
    PYTHONPATH=. python3 benchmarks/mla_compile_check.py                       # the table's entries
    PYTHONPATH=. python3 benchmarks/mla_compile_check.py --tile 16,32,512,4,3,1,3,0 --fp8
Tile: ``block_h,block_n,block_v,num_warps,num_stages,swap,ctas_per_sm,f16`` (MLADecodeConfig).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvserve.attention.triton.mla_decode import (  # noqa: E402
    MLA_DECODE_CONFIGS, MLADecodeConfig, _mla_decode_split_kernel)


def compile_tile(cfg: MLADecodeConfig, fp8: bool, arch: int = 90, lora: int = 512, rope: int = 64) -> dict:
    """Compile one tile (bf16 query; bf16 or FP8 rows of ``lora + rope`` values) for ``sm_<arch>``."""
    bl, br = triton.next_power_of_2(lora), max(triton.next_power_of_2(rope), 16)
    bv = min(cfg.block_v, bl)
    sig = {"q_ptr": "*bf16", "cache_ptr": "*u8" if fp8 else "*bf16", "bt_ptr": "*i32", "lens_ptr": "*i32",
           "out_ptr": "*fp32", "lse_ptr": "*fp32", "num_heads": "i32", "num_splits": "i32", "stride_bt": "i32",
           "block_size": "i32", "qk_scale_log2": "fp32"}
    row = lora + rope + 2 if fp8 else lora + rope
    const = dict(L=lora, R=rope, BLOCK_L=bl, BLOCK_R=br, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_V=bv,
                 NUM_CB=bl // bv, ROW=-(-row // 16) * 16, FP8=fp8, SWAP=cfg.swap, F16=fp8 and cfg.f16,
                 DOT_PREC="tf32")
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 9)}
    ck = triton.compile(ASTSource(_mla_decode_split_kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = ck.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", f"sm_{arch}a", os.path.join(d, "k.ptx"), "-o",
                            os.path.join(d, "k.o")], capture_output=True, text=True)
    report = " ".join(x.split(":", 1)[-1].strip() for x in r.stderr.splitlines() if "registers" in x or "spill" in x)
    return dict(shared_bytes=ck.metadata.shared, mma="wgmma" if "wgmma" in ptx else
                ("mma.sync" if "mma.sync" in ptx else "none"), cp_async=ptx.count("cp.async"), ptxas=report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tile", action="append", default=[], help="block_h,block_n,block_v,warps,stages,swap,ctas,f16")
    ap.add_argument("--fp8", action="store_true", help="FP8 rows for --tile")
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    todo = []
    for t in a.tile:
        bh, bn, bv, nw, ns, sw, ctas, f16 = (int(x) for x in t.split(","))
        todo.append((MLADecodeConfig(bh, bn, bv, nw, ns, bool(sw), ctas, bool(f16)), a.fp8, t))
    if not todo:
        todo = [(cfg, dt == "fp8", f"{h} heads {dt}") for (h, dt), cfg in MLA_DECODE_CONFIGS.items()]
    for cfg, fp8, name in todo:
        try:
            print(name, cfg, compile_tile(cfg, fp8, a.arch), flush=True)
        except Exception as e:  # a tile Triton refuses
            print(name, cfg, "error:", repr(e)[:300], flush=True)


if __name__ == "__main__":
    main()
