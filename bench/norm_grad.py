"""A training step's bf16 RMS norm backward and gated-MLP activation (SwiGLU) backward: the
host kernels against autograd's.

For each shape (``--shapes``, ``rows x dim``: a block's norm over ``batch * length`` rows of
the hidden size), it times Hugging Face's ``LlamaRMSNorm`` forward + backward with autograd
through its seven operations, its forward alone, and the forward with the engine's backward
(:mod:`bb_lightning.engine.train_norm`, the kernel ``bb_rms_norm_backward``), in turns, best of
each within ``--seconds``: a neighbour's load slows them alike, so their ratio holds on a
shared machine. It prints the machine, milliseconds of each, the two backwards (forward +
backward less the forward) and their ratio, and each gradient's error against float64 (the
input's and the weight's), the kernel's and autograd's. The host allocator keeps freed memory
(:func:`~bb_lightning.engine.inference.keep_host_allocations`), as in a fit on a CPU device.

For each ``--mlp-shapes`` (``rows x intermediate``: a block's gate and up projections over
``batch * length`` rows), it times ``F.silu(gate) * up`` forward + backward with autograd,
and with :mod:`bb_lightning.engine.train_mlp`'s kernels (``bb_silu_mul`` and
``bb_silu_mul_backward``), in turns the same way, and prints both, their ratio, and the gate's
and the up projection's gradient errors against float64.

Where the kernels do not build (no compiler, ``BB_NATIVE=0``) it says so and times nothing:
training then runs autograd's backward.

Run: ``.venv/bin/python bench/norm_grad.py [--shapes 512x1024,2048x1024] [--mlp-shapes
2048x2816] [--json PATH]``
"""

from __future__ import annotations

import argparse
import copy

import _common
import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from bb_lightning.engine import host_norm, train_mlp, train_norm
from bb_lightning.engine.inference import keep_host_allocations


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="512x1024,2048x1024,512x4096,4096x4096",
                        help="rows x dim, comma-separated")  # fmt: skip
    parser.add_argument("--mlp-shapes", default="512x2816,2048x2816,4096x11008",
                        help="rows x intermediate of the gated MLP, comma-separated")  # fmt: skip
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


def _mlp_shape(shape: str, seconds: float, g: torch.Generator) -> dict[str, object]:
    """Time and check one ``rows x intermediate`` gated-MLP activation; print its line."""
    rows, inner = (int(n) for n in shape.split("x"))
    gate = (3 * torch.randn(rows, inner, generator=g)).bfloat16().requires_grad_()
    up = torch.randn(rows, inner, generator=g).bfloat16().requires_grad_()
    grad = torch.randn(rows, inner, generator=g).bfloat16()

    def autograd() -> None:
        torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), grad)

    def kernel() -> None:
        torch.autograd.grad(train_mlp._SiluMul.apply(gate, up), (gate, up), grad)

    best = _common.best_seconds({"autograd": autograd, "kernel": kernel}, seconds)
    g64, u64 = gate.double(), up.double()
    exact = torch.autograd.grad(torch.nn.functional.silu(g64) * u64, (g64, u64), grad.double())
    theirs = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), grad)
    mine = torch.autograd.grad(train_mlp._SiluMul.apply(gate, up), (gate, up), grad)
    errors = {
        name: [float((o.double() - w).norm() / w.norm()), float((t.double() - w).norm() / w.norm())]
        for name, o, t, w in zip(("dgate", "dup"), mine, theirs, exact, strict=True)
    }
    ratio = best["autograd"] / best["kernel"]
    print(
        f"mlp {shape}: forward + backward autograd {best['autograd'] * 1e3:.3f} ms, kernels "
        f"{best['kernel'] * 1e3:.3f} ms, autograd / kernels = {ratio:.2f}; error against float64 "
        "(kernels, autograd): "
        + ", ".join(f"{n} {e[0]:.2e} {e[1]:.2e}" for n, e in errors.items()),
        flush=True,
    )
    return {"autograd_ms": best["autograd"] * 1e3, "kernel_ms": best["kernel"] * 1e3,
            "speedup": ratio, "errors": errors}  # fmt: skip


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
    mlp = {
        shape: _mlp_shape(shape, args.seconds, g) for shape in args.mlp_shapes.split(",") if shape
    }
    _common.write_figures(args.json, "norm_grad", {"kernel": True, "shapes": figures, "mlp": mlp})


if __name__ == "__main__":
    main()
