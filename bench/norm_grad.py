"""A training step's bf16 RMS norm backward: the host kernel against autograd's.

For each shape (``--shapes``, ``rows x dim``: a block's norm over ``batch * length`` rows of
the hidden size), it times Hugging Face's ``LlamaRMSNorm`` forward + backward with autograd
through its seven operations, its forward alone, and the forward with the engine's backward
(:mod:`bb_lightning.engine.train_norm`, the kernel ``bb_rms_norm_backward``), in turns, best of
each within ``--seconds``: a neighbour's load slows them alike, so their ratio holds on a
shared machine. It prints the machine, milliseconds of each, the two backwards (forward +
backward less the forward) and their ratio, and each gradient's error against float64 (the
input's and the weight's), the kernel's and autograd's. The host allocator keeps freed memory
(:func:`~bb_lightning.engine.inference.keep_host_allocations`), as in a fit on a CPU device.

Where the kernels do not build (no compiler, ``BB_NATIVE=0``) it says so and times nothing:
training then runs autograd's backward.

Run: ``.venv/bin/python bench/norm_grad.py [--shapes 512x1024,2048x1024] [--json PATH]``
"""

from __future__ import annotations

import argparse
import copy

import _common
import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from bb_lightning.engine import host_norm, train_norm
from bb_lightning.engine.inference import keep_host_allocations


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="512x1024,2048x1024,512x4096,4096x4096",
                        help="rows x dim, comma-separated")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=3.0, help="timing per shape")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    return parser.parse_args()


def _grads(norm: torch.nn.Module, x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    norm.zero_grad(set_to_none=True)
    given = x.detach().clone().requires_grad_()
    norm(given).backward(grad.to(given.dtype))
    return given.grad, norm.weight.grad  # type: ignore[return-value]


def _shape(shape: str, seconds: float, g: torch.Generator) -> dict[str, object]:
    """Time and check one ``rows x dim`` shape; print its line."""
    rows, dim = (int(n) for n in shape.split("x"))
    norm = LlamaRMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=g))
    norm = norm.bfloat16()
    ours = copy.deepcopy(norm)
    restore = train_norm.install(torch.device("cpu"), ours)
    x = (3 * torch.randn(rows, dim, generator=g)).bfloat16().requires_grad_()
    grad = torch.randn(rows, dim, generator=g).bfloat16()

    def autograd() -> None:
        torch.autograd.grad(norm(x), (x, norm.weight), grad)

    def forward() -> None:
        with torch.no_grad():
            norm(x)

    def kernel() -> None:
        torch.autograd.grad(ours(x), (x, ours.weight), grad)

    try:
        best = _common.best_seconds(
            {"autograd": autograd, "forward": forward, "kernel": kernel}, seconds
        )
        exact = _grads(copy.deepcopy(norm).double(), x.double(), grad.double())
        mine, theirs = _grads(ours, x, grad), _grads(norm, x, grad)
    finally:
        restore()
    back_theirs, back_ours = best["autograd"] - best["forward"], best["kernel"] - best["forward"]
    errors = {
        name: [float((o.double() - w).norm() / w.norm()), float((t.double() - w).norm() / w.norm())]
        for name, o, t, w in zip(("dx", "dw"), mine, theirs, exact, strict=True)
    }
    print(
        f"{shape}: autograd forward + backward {best['autograd'] * 1e3:.3f} ms, forward "
        f"{best['forward'] * 1e3:.3f} ms, with the kernel's backward {best['kernel'] * 1e3:.3f} "
        f"ms; backward autograd {back_theirs * 1e3:.3f} ms, kernel {back_ours * 1e3:.3f} ms, "
        f"autograd / kernel = {back_theirs / back_ours:.2f}; error against float64 (kernel, "
        "autograd): " + ", ".join(f"{n} {e[0]:.2e} {e[1]:.2e}" for n, e in errors.items()),
        flush=True,
    )
    return {"autograd_ms": best["autograd"] * 1e3, "forward_ms": best["forward"] * 1e3,
            "kernel_ms": best["kernel"] * 1e3, "speedup": back_theirs / back_ours,
            "errors": errors}  # fmt: skip


def main() -> None:
    args = _args()
    print(_common.machine(None), flush=True)
    keep_host_allocations()
    if host_norm.kernel() is None:
        print("no host kernels here (no compiler, or BB_NATIVE=0): autograd's backward runs")
        _common.write_figures(args.json, "norm_grad", {"kernel": False})
        return
    g = torch.Generator().manual_seed(0)
    figures = {shape: _shape(shape, args.seconds, g) for shape in args.shapes.split(",")}
    _common.write_figures(args.json, "norm_grad", {"kernel": True, "shapes": figures})


if __name__ == "__main__":
    main()
