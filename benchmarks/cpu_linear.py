"""CPU projections: the native panel kernel (`cpu_kernels.linear`) against oneDNN's packed matmul (and MKL).

    python benchmarks/cpu_linear.py [--rows 1,8,16,32,64,96,128,256] [--layers 30] [--repeats 3] [--mkl]

The projections of the bundled SmolLM2-135M (hidden 576, intermediate 1536: qkv 576->960, o 576->576, gate/up
576->3072, down 1536->576) for `--layers` layers, each with its own weight so that a pass streams all of them
from memory as a decode step does (30 layers: 424 MB in float32, far past the last-level cache). For each row
count, prints milliseconds per pass (best of `--repeats`, the paths interleaved so that a noisy machine slows
them alike), the GFLOP/s and the weight bytes read per second. This is where `linear.NATIVE_MAX_ROWS` comes from.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers.linear import PackedLinear, is_packing_available

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) per layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16,32,64,96,128,256")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mkl", action="store_true", help="also time plain F.linear (MKL sgemm)")
    args = parser.parse_args()
    if not (is_packing_available() and cpu_kernels.is_available()):
        sys.exit("needs oneDNN in this torch build and the native CPU kernels")
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    layers = [
        (n_in, PackedLinear(torch.nn.Linear(n_in, n_out, bias=False), native_max_rows=max(rows)))
        for _ in range(args.layers)
        for n_in, n_out in SHAPES
    ]
    paths = ["oneDNN packed", "cpu_kernels"] + (["F.linear (MKL)"] if args.mkl else [])
    plain = [torch.randn(layer.out_features, n_in) for n_in, layer in layers] if args.mkl else []
    best = {(path, m): float("inf") for path in paths for m in rows}
    for _ in range(args.repeats):
        for m in rows:
            inputs = {n_in: torch.randn(m, n_in) for n_in in (576, 1536)}
            for path in paths:
                start = time.perf_counter()
                for i, (n_in, layer) in enumerate(layers):
                    x = inputs[n_in]
                    if path == "cpu_kernels":
                        assert layer.panels is not None
                        cpu_kernels.linear(x, layer.panels, layer.out_features, None)
                    elif path == "oneDNN packed":
                        torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
                    else:
                        torch.nn.functional.linear(x, plain[i])  # row-major (the packed layouts hold others)
                best[path, m] = min(best[path, m], time.perf_counter() - start)
    flops_per_row = 2 * args.layers * sum(i * o for i, o in SHAPES)
    weight_bytes = 4 * args.layers * sum(i * o for i, o in SHAPES)
    print(f"{args.layers} layers, {weight_bytes / 1e6:.0f} MB of float32 weights, {torch.get_num_threads()} threads")
    print(f"{'ms per pass':18s}" + "".join(f"{m:>8d}" for m in rows))
    for path in paths:
        print(f"{path:18s}" + "".join(f"{best[path, m] * 1e3:8.1f}" for m in rows))
    print(f"{'GFLOP/s':18s}")
    for path in paths:
        print(f"  {path:16s}" + "".join(f"{flops_per_row * m / best[path, m] / 1e9:8.1f}" for m in rows))
    print(f"{'weight GB/s':18s}")
    for path in paths:
        print(f"  {path:16s}" + "".join(f"{weight_bytes / best[path, m] / 1e9:8.1f}" for m in rows))


if __name__ == "__main__":
    main()
