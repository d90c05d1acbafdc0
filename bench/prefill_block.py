"""A bf16 prefill through one Llama block: the engine's host kernels against torch's operations.

The block is one of the 374M Llama that ``bench/predict_offload.py`` runs (hidden 1024, MLP
2816, 16 heads of 64; ``--hidden``, ``--ffn``, ``--heads``), fed a prefill chunk of
``--prompts`` prompts of ``--tokens`` tokens as the engine cuts it (16 x 128: 2048 rows).
It times, one of each per round, best of each within ``--seconds`` (a neighbour's load slows
both alike, so their ratio holds on a shared machine):

- the whole block, as transformers runs it (torch's operations, ``sdpa``'s fused attention)
  and as the inference engine runs it on a CPU device (the one-pass RMS norms, rotary
  embedding and gated MLP of ``host_ops.c``; the prefill's attention of ``host_linear.c``
  on the matrix tiles, or on AVX-512's bf16 products, where the CPU has either);
- its attention alone: ``sdpa`` against that kernel (causal, as a prompt without padding
  runs);
- its MLP alone: ``act_fn(gate) * up`` as two operations against the one pass.

It prints the machine, milliseconds of each and torch's / the kernels', and how many of the
block's outputs equal torch's (the compiled attention rounds its sums otherwise).

Run: ``.venv/bin/python bench/prefill_block.py [--prompts 16 --tokens 128] [--json PATH]``
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import _common
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from bb_lightning.engine import host_linear, host_mlp, host_norm, host_rope
from bb_lightning.engine.attention import decode_attention_for
from bb_lightning.engine.inference import keep_host_allocations


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts in the chunk")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0, help="timing per comparison")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    return parser.parse_args()


def main() -> None:
    args = _args()
    keep_host_allocations()  # as the engine runs: freed activations reused, not unmapped
    print(_common.machine(None), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if host_norm.kernel() is None:
        print("the host kernels did not build here (or BB_NATIVE=0): torch's operations run")
        _common.write_figures(args.json, "prefill_block", {"kernels": False})
        return
    tiles = host_linear.attention_kernel() is not None
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    block = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16).eval()
    x = torch.randn(args.prompts, args.tokens, args.hidden).to(torch.bfloat16)
    positions = torch.arange(args.tokens).expand(args.prompts, -1)
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = (t.to(torch.bfloat16) for t in rotary(x, positions))

    def run_block() -> torch.Tensor:
        out = block(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    attn, mlp = block.self_attn, block.mlp
    figures: dict[str, object] = {"kernels": True, "tiles": tiles}
    with torch.no_grad():
        h = block.input_layernorm(x)
        shape = (args.prompts, args.tokens, args.heads, args.hidden // args.heads)
        q, k, v = (
            p(h).view(shape).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)

        def kernels(
            *installs: Callable[[torch.nn.Module], Callable[[], None]], attend: bool = True
        ) -> torch.Tensor:
            undo = [install(block) for install in installs]
            try:
                if not attend:  # transformers' own sdpa, as the engine runs it without tiles
                    return run_block()
                with decode_attention_for(block):
                    return run_block()
            finally:
                for done in undo:
                    done()

        def ours() -> torch.Tensor:
            return kernels(host_norm.install, host_rope.install, host_mlp.install)

        def norms_rotary() -> torch.Tensor:
            return kernels(host_norm.install, host_rope.install, attend=False)

        equal = (ours() == run_block()).float().mean().item()
        kern = host_norm.kernel()
        assert kern is not None
        rows: list[tuple[str, dict[str, Callable[[], object]]]] = [
            ("block", {"torch": run_block, "norms and rotary": norms_rotary, "kernels": ours}),
            ("MLP's SiLU and product", {"torch": lambda: mlp.act_fn(gate) * up,
                                        "kernels": lambda: kern.silu_mul(gate, up)}),
        ]  # fmt: skip
        tiles_kernel = host_linear.attention_kernel()
        if tiles_kernel is not None:
            scale = q.shape[-1] ** -0.5
            rows.append(("attention", {
                "torch": lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True).transpose(1, 2).contiguous(),
                "kernels": lambda: tiles_kernel.prefill_attention(q, k, v, None, True, scale),
            }))  # fmt: skip
        for name, runs in rows:
            best = _common.best_seconds(runs, args.seconds)
            ratio = best["torch"] / best["kernels"]
            print(f"{name}: torch {best['torch'] * 1e3:.2f} ms, kernels "
                  f"{best['kernels'] * 1e3:.2f} ms, torch / kernels = {ratio:.2f}")  # fmt: skip
            figures[name] = {"torch_ms": best["torch"] * 1e3,
                             "kernels_ms": best["kernels"] * 1e3, "ratio": ratio}  # fmt: skip
            if "norms and rotary" in best:
                part = best["norms and rotary"]
                print(f"{name}, with only the norms and rotary embedding in one pass: "
                      f"{part * 1e3:.2f} ms, torch / that = {best['torch'] / part:.2f}, "
                      f"that / kernels = {part / best['kernels']:.2f}")  # fmt: skip
                figures[name] |= {"norms_rotary_ms": part * 1e3}  # type: ignore[operator]
    print(f"block outputs equal to torch's: {equal:.1%}"
          + ("" if tiles else " (no compiled attention here: the attention is sdpa's)"))  # fmt: skip
    figures["equal"] = equal
    _common.write_figures(args.json, "prefill_block", figures)


if __name__ == "__main__":
    main()
