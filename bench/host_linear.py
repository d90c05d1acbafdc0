"""A decode step's bf16 products with few rows: the compiled kernel against torch's.

For each weight shape (``--shapes``, ``in x out`` of a block's linear layers and the head of
the 374M Llama that ``bench/predict_offload.py`` runs) and each number of rows (``--rows``,
the sequences of a decode step), it times ``torch.nn.functional.linear`` and the engine's
kernel (:mod:`bb_lightning.engine.host_linear`) over ``--weights`` distinct weights in turn,
so that each call reads its weight from memory as a paged-in block's first use does (the
weights together exceed the CPU's caches), one round of each in turns, best of each within
``--seconds``: a neighbour's load slows both alike, so their ratio holds on a shared
machine. It prints the machine, microseconds per product of each, their ratio, and the
kernel's TFLOP/s and weight bytes per second; and the share of outputs that equal torch's
(the kernel sums in another order, see the module).

The kernel runs on the CPU's bf16 matrix tiles, or without them on AVX-512's bf16 pair
products (it prints which). Where the CPU has neither it says so and times nothing: the
engine then runs torch's products.

Run: ``.venv/bin/python bench/host_linear.py [--rows 1,16,64,128,256,512] [--json PATH]``
"""

from __future__ import annotations

import argparse

import _common
import torch
import torch.nn.functional as F

from bb_lightning.engine import host_linear


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,128,256,512",
                        help="rows of input (a decode step's sequences), comma-separated")  # fmt: skip
    parser.add_argument("--shapes", default="1024x1024,1024x2816,2816x1024,1024x32000",
                        help="weights as in x out, comma-separated (multiples of 32)")  # fmt: skip
    parser.add_argument("--weights", type=int, default=0,
                        help="distinct weights per shape, called in turn (0: enough for 192 MiB)")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per row count")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    return parser.parse_args()


def main() -> None:
    args = _args()
    print(_common.machine(None), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    kern = host_linear.kernel()
    if kern is None:
        print("no bf16 matrix tiles or vector pair products here (or BB_NATIVE=0): torch's "
              "products run")  # fmt: skip
        _common.write_figures(args.json, "host_linear", {"kernel": False})
        return
    print(f"kernel: products on the {'matrix tiles' if kern.tiles else 'vectors'}", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    figures: dict[str, dict[str, float]] = {}
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        count = args.weights or max(2, (192 << 20) // (2 * n * k))
        weights = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16) for _ in range(count)]
        for m in rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)

            def theirs(x: torch.Tensor = x, weights: list[torch.Tensor] = weights) -> None:
                for w in weights:
                    F.linear(x, w)

            def ours(x: torch.Tensor = x, weights: list[torch.Tensor] = weights) -> None:
                for w in weights:
                    kern(x, w)

            with torch.inference_mode():
                best = _common.best_seconds({"torch": theirs, "kernel": ours}, args.seconds)
                same = float((kern(x, weights[0]) == F.linear(x, weights[0])).double().mean())
            t, o = best["torch"] / count, best["kernel"] / count
            print(
                f"{k} x {n}, {m} rows: torch {t * 1e6:.0f} us, kernel {o * 1e6:.0f} us, "
                f"torch / kernel = {t / o:.2f}; kernel {2 * m * k * n / o / 1e12:.2f} TFLOP/s, "
                f"weight {2 * n * k / o / 1e9:.1f} GB/s; outputs equal to torch's {same:.2%}",
                flush=True,
            )
            figures[f"{k}x{n}x{m}"] = {"torch_us": t * 1e6, "kernel_us": o * 1e6,
                                       "speedup": t / o, "equal_share": same}  # fmt: skip
    _common.write_figures(args.json, "host_linear", {"kernel": True, "products": figures})


if __name__ == "__main__":
    main()
