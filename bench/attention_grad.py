"""A training step's bf16 attention backward: the matrix-tile kernel against torch's.

For each shape (``--shapes``, ``batch x heads x length x dim``; causal self-attention, a
Llama block's in a training step), it times torch's fused CPU attention (the flash kernel
that transformers' ``sdpa`` runs) forward and backward, its forward alone, and the forward
with the engine's backward on the tiles (:mod:`bb_lightning.engine.train_attention`), in
turns, best of each within ``--seconds``: a neighbour's load slows them alike, so their
ratio holds on a shared machine. It prints the machine, milliseconds of each, the two
backwards (fused forward + backward less the forward) and their ratio, and each backward's
TFLOP/s over its causal FLOPs (five products of ``length**2 * dim`` a head, half of them
past the diagonal); and each gradient's error against float64, the kernel's and torch's.

Where the CPU has no bf16 matrix tiles (or the operating system does not grant them) it says
so and times nothing: training then runs torch's backward.

Run: ``.venv/bin/python bench/attention_grad.py [--shapes 4x16x512x64,1x16x512x64] [--json PATH]``
"""

from __future__ import annotations

import argparse

import _common
import torch
import torch.nn.functional as F
from torch import Tensor

from bb_lightning.engine import host_linear, train_attention


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4x16x512x64,1x16x512x64,1x16x2048x64,2x32x512x128",
                        help="batch x heads x length x dim, comma-separated (dim a multiple "
                             "of 32)")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=3.0, help="timing per shape")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    return parser.parse_args()


def _errors(q: Tensor, k: Tensor, v: Tensor, grad: Tensor) -> dict[str, list[float]]:
    """Each gradient's error norm over the float64 gradient's norm: the kernel's, torch's."""
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*exact, is_causal=True)
    want = torch.autograd.grad(out, exact, grad.double())
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                 (q, k, v), grad)  # fmt: skip
    ours = torch.autograd.grad(
        train_attention._TilesBackward.apply(q, k, v, True, q.shape[-1] ** -0.5), (q, k, v), grad
    )
    return {
        name: [float((o.double() - w).norm() / w.norm()), float((t.double() - w).norm() / w.norm())]
        for name, o, t, w in zip(("dq", "dk", "dv"), ours, theirs, want, strict=True)
    }


def _shape(shape: str, seconds: float, g: torch.Generator) -> dict[str, object]:
    """Time and check one ``batch x heads x length x dim`` shape; print its line."""
    batch, heads, length, dim = (int(x) for x in shape.split("x"))
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g).bfloat16().requires_grad_()
               for _ in range(3))  # fmt: skip
    grad = torch.randn(batch, heads, length, dim, generator=g).bfloat16()
    scale = dim**-0.5

    def fused() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    def forward() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def tiles() -> None:
        out = train_attention._TilesBackward.apply(q, k, v, True, scale)
        torch.autograd.grad(out, (q, k, v), grad)

    best = _common.best_seconds({"fused": fused, "forward": forward, "tiles": tiles}, seconds)
    theirs, ours = best["fused"] - best["forward"], best["tiles"] - best["forward"]
    flops = 5 * 2 * batch * heads * length * length * dim / 2
    errors = _errors(q, k, v, grad)
    print(
        f"{shape}: torch forward + backward {best['fused'] * 1e3:.2f} ms, forward "
        f"{best['forward'] * 1e3:.2f} ms, with the tiles' backward {best['tiles'] * 1e3:.2f} "
        f"ms; backward torch {theirs * 1e3:.2f} ms ({flops / theirs / 1e12:.2f} TFLOP/s), "
        f"tiles {ours * 1e3:.2f} ms ({flops / ours / 1e12:.2f} TFLOP/s), torch / tiles = "
        f"{theirs / ours:.2f}; error against float64 (tiles, torch): "
        + ", ".join(f"{n} {e[0]:.2e} {e[1]:.2e}" for n, e in errors.items()),
        flush=True,
    )
    return {"fused_ms": best["fused"] * 1e3, "forward_ms": best["forward"] * 1e3,
            "tiles_ms": best["tiles"] * 1e3, "speedup": theirs / ours, "errors": errors}  # fmt: skip


def main() -> None:
    args = _args()
    print(_common.machine(None), flush=True)
    if host_linear.kernel() is None:
        print("no bf16 matrix tiles here (or not granted, or BB_NATIVE=0): torch's backward runs")
        _common.write_figures(args.json, "attention_grad", {"kernel": False})
        return
    g = torch.Generator().manual_seed(0)
    figures = {shape: _shape(shape, args.seconds, g) for shape in args.shapes.split(",")}
    _common.write_figures(args.json, "attention_grad", {"kernel": True, "shapes": figures})


if __name__ == "__main__":
    main()
