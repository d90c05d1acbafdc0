"""A training step's bf16 attention forward and backward: the compiled kernel against torch's.

For each shape (``--shapes``, ``batch x heads x length x dim``; causal self-attention, a
Llama block's in a training step), it times torch's fused CPU attention (the flash kernel
that transformers' ``sdpa`` runs) forward and backward and its forward alone, and the
engine's compiled attention (:mod:`bb_lightning.engine.train_attention`: on the matrix tiles,
or without them on AVX-512's bf16 pair products; it prints which) the same two ways, in
turns, best of each within ``--seconds``: a neighbour's load slows them alike, so their
ratio holds on a shared machine. It prints the machine, milliseconds of each, torch's / the
kernel's for the whole and for the forwards, the two backwards (forward + backward less the
forward) and their ratio, and each backward's TFLOP/s over its causal FLOPs (five products
of ``length**2 * dim`` a head, half of them past the diagonal); and the output's and each
gradient's error against float64, the kernel's and torch's.

Where the CPU has neither bf16 matrix tiles (or the operating system does not grant them) nor
AVX-512's bf16 products, it says so and times nothing: training then runs torch's backward.

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
    """The output's and each gradient's error norm over the float64 one's norm: the kernel's,
    torch's."""
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*exact, is_causal=True)
    want = [out.detach(), *torch.autograd.grad(out, exact, grad.double())]
    out_t = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    theirs = [out_t.detach(), *torch.autograd.grad(out_t, (q, k, v), grad)]
    out_o = train_attention._KernelAttention.apply(q, k, v, True, q.shape[-1] ** -0.5)
    ours = [out_o.detach().transpose(1, 2),
            *torch.autograd.grad(out_o, (q, k, v), grad.transpose(1, 2))]  # fmt: skip
    return {
        name: [float((o.double() - w).norm() / w.norm()), float((t.double() - w).norm() / w.norm())]
        for name, o, t, w in zip(("out", "dq", "dk", "dv"), ours, theirs, want, strict=True)
    }


def _shape(shape: str, seconds: float, g: torch.Generator) -> dict[str, object]:
    """Time and check one ``batch x heads x length x dim`` shape; print its line."""
    batch, heads, length, dim = (int(x) for x in shape.split("x"))
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g).bfloat16().requires_grad_()
               for _ in range(3))  # fmt: skip
    grad = torch.randn(batch, heads, length, dim, generator=g).bfloat16()
    grad_t = grad.transpose(1, 2)  # the kernel's output is [batch, len, heads, dim]
    scale = dim**-0.5

    def fused() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    def forward() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def kernel() -> None:
        out = train_attention._KernelAttention.apply(q, k, v, True, scale)
        torch.autograd.grad(out, (q, k, v), grad_t)

    def kernel_forward() -> None:
        with torch.no_grad():
            train_attention._KernelAttention.apply(q, k, v, True, scale)

    best = _common.best_seconds({"fused": fused, "forward": forward, "kernel": kernel,
                                 "kernel_forward": kernel_forward}, seconds)  # fmt: skip
    theirs, ours = best["fused"] - best["forward"], best["kernel"] - best["kernel_forward"]
    flops = 5 * 2 * batch * heads * length * length * dim / 2
    errors = _errors(q, k, v, grad)
    print(
        f"{shape}: torch forward + backward {best['fused'] * 1e3:.2f} ms (forward "
        f"{best['forward'] * 1e3:.2f} ms), the kernel's {best['kernel'] * 1e3:.2f} ms (forward "
        f"{best['kernel_forward'] * 1e3:.2f} ms), torch / kernel = "
        f"{best['fused'] / best['kernel']:.2f}, forwards {best['forward'] / best['kernel_forward']:.2f}; "
        f"backward torch {theirs * 1e3:.2f} ms ({flops / theirs / 1e12:.2f} TFLOP/s), "
        f"kernel {ours * 1e3:.2f} ms ({flops / ours / 1e12:.2f} TFLOP/s), backwards torch / kernel "
        f"= {theirs / ours:.2f}; error against float64 (kernel, torch): "
        + ", ".join(f"{n} {e[0]:.2e} {e[1]:.2e}" for n, e in errors.items()),
        flush=True,
    )
    return {"fused_ms": best["fused"] * 1e3, "forward_ms": best["forward"] * 1e3,
            "kernel_ms": best["kernel"] * 1e3, "kernel_forward_ms": best["kernel_forward"] * 1e3,
            "speedup": best["fused"] / best["kernel"], "backward_speedup": theirs / ours,
            "forward_speedup": best["forward"] / best["kernel_forward"],
            "errors": errors}  # fmt: skip


def main() -> None:
    args = _args()
    print(_common.machine(None), flush=True)
    kern = host_linear.attention_kernel()
    if kern is None:
        print(
            "neither bf16 matrix tiles nor AVX-512's bf16 products here (or not granted, or "
            "BB_NATIVE=0): torch's backward runs"
        )
        _common.write_figures(args.json, "attention_grad", {"kernel": False})
        return
    print(f"the kernel's products run on the {'matrix tiles' if kern.tiles else 'vectors'}")
    g = torch.Generator().manual_seed(0)
    figures = {shape: _shape(shape, args.seconds, g) for shape in args.shapes.split(",")}
    _common.write_figures(args.json, "attention_grad", {"kernel": True, "shapes": figures})


if __name__ == "__main__":
    main()
