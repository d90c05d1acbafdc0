"""The parts of any Hugging Face causal LM, found by structure and one meta-device trace.

No class names, no attribute names: the repeated blocks are the ``nn.ModuleList``
with the most parameters whose children are of one type, or of several that each keep
parameters in modules of their own (hybrid models that interleave attention and
state-space layers), and no two blocks may share a parameter; the input
embedding and output head come from ``get_input_embeddings()`` /
``get_output_embeddings()``; every other parameter is placed by when the
forward first touches it, before the first block (embedding side) or after the
last one (final side). The forward runs on the meta device with meta stand-ins
for the parameters, so it costs no memory and no arithmetic and never changes
the model.

The same trace records which block parameters feed matrix products and how many
bytes each block saves for backward, which :class:`ModelProfile` needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bb_lightning.engine.hf_quirks import (
    activation_checkpointing,
    config_int,
    config_value,
    model_context,
    no_pad_token,
    resolve_model,
)

__all__ = [
    "TRACE_CONTEXT",
    "FusedAttentionStandIn",
    "ModelParts",
    "check_block_calls",
    "find_block_list",
    "find_parts",
    "fused_attention",
    "load_config",
    "profile_fields_from_config",
    "profile_fields_from_module",
]

TRACE_CONTEXT = 256
"""Tokens of the single sequence the meta trace runs (batch 1)."""

_FUSED_ATTENTION = "bb_fused_meta"
"""Attention implementation name used only during the meta trace."""

_MATMUL_OPERANDS: dict[str, tuple[int, int]] = {
    "aten::mm": (0, 1),
    "aten::bmm": (0, 1),
    "aten::matmul": (0, 1),
    "aten::_grouped_mm": (0, 1),
    "aten::addmm": (1, 2),
    "aten::baddbmm": (1, 2),
}
"""Matrix-product ops and the positions of their two matrix operands (not the bias)."""


@dataclass(frozen=True, kw_only=True)
class ModelParts:
    """Where the embedding, repeated blocks, final part and head of a causal LM live."""

    blocks_path: str
    """Module path of the repeated block list, e.g. ``"model.layers"``."""
    block_names: tuple[str, ...]
    """Module paths of the blocks in execution order, e.g. ``("model.layers.0", ...)``."""
    block_param_names: tuple[tuple[str, ...], ...]
    """Parameter names of each block (model-level names), one tuple per block."""
    embed_param_names: tuple[str, ...]
    """Parameters first used before the first block (input embedding, positions, projections)."""
    final_param_names: tuple[str, ...]
    """Parameters first used after the last block, other than the head (final norm, ...)."""
    head_param_names: tuple[str, ...]
    """Output head parameters not shared with the input embedding (empty when tied)."""
    unused_param_names: tuple[str, ...]
    """Parameters outside the blocks that the forward never touches."""
    input_embedding: str
    """Module path of ``model.get_input_embeddings()``."""
    output_head: str | None
    """Module path of ``model.get_output_embeddings()`` (``None`` when the model has none)."""
    tied_embeddings: bool
    """Whether the output head's weight is the input embedding's weight object."""


@dataclass
class _Trace:
    """What one meta forward (+ loss) recorded."""

    first_use: dict[str, int] = field(default_factory=dict)
    """Parameter name -> index of the first dispatched op that read it."""
    block_spans: list[tuple[int, int]] = field(default_factory=list)
    """Per block: (op index at entry, op index at exit)."""
    matmul_params: set[str] = field(default_factory=set)
    """Parameter names read by a matrix-product op."""
    saved_bytes: list[int] = field(default_factory=list)
    """Per block: bytes of distinct non-parameter storages saved for backward."""
    swapped_bytes: list[int] = field(default_factory=list)
    """Per block: bytes saved as a swapped block stores them (each view; no int, no broadcast)."""
    tokens: int = 0
    """Tokens in the traced batch."""
    calls: list[int] = field(default_factory=list)
    """Indices of the blocks in the order the forward entered them."""
    block_args: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    """Per block: the positional and keyword arguments of its first call (meta tensors)."""
    fused: bool = True
    """Whether attention ran through :class:`FusedAttentionStandIn`."""


def _module_path(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise AssertionError("module is not a submodule of the model")


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Path and module of the repeated block list (see the module docstring).

    Raises ``ValueError`` when there is none, or when two of its blocks share a parameter
    (one layer's weights used by several: each block is paged with its own).
    """
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if not _holds_blocks(module):
            continue
        n = _count(module)
        if n > 0 and (best is None or n > best[0]):
            best = (n, name, module)
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of blocks (children of one type, "
            "or layers whose parameters sit in modules of their own) holding parameters, so "
            "its repeated blocks cannot be found: keep the decoder layers in one nn.ModuleList "
            "(as Hugging Face causal LMs do)"
        )
    _check_unshared(model, best[1], best[2])
    return best[1], best[2]


def _holds_blocks(layers: nn.ModuleList) -> bool:
    """Children of one type, or of several that each keep parameters in modules of their
    own (a hybrid model's mamba and attention layers; not a list of bare layers)."""
    if len({type(child) for child in layers}) == 1:
        return True
    return all(any(_count(sub) > 0 for sub in child.children()) for child in layers)


def _check_unshared(model: nn.Module, path: str, blocks: nn.ModuleList) -> None:
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for key, p in block.named_parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                raise ValueError(
                    f"{type(model).__name__}: blocks {j} and {i} of {path or 'the model'} share "
                    f"the parameter {key!r} (one set of weights used by several layers), and "
                    "balance_beam pages each block with weights of its own: train and run "
                    "this model under plain Lightning"
                )


class _Recorder(TorchDispatchMode):
    """Counts dispatched ops; notes first reads of parameters and matmul operands."""

    def __init__(self, storage_to_name: dict[int, str], trace: _Trace) -> None:
        super().__init__()
        self.ops = 0
        self.storage_to_name = storage_to_name
        self.trace = trace

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops += 1
        flat, _ = tree_flatten((args, kwargs or {}))
        for arg in flat:
            if isinstance(arg, torch.Tensor):
                name = self.storage_to_name.get(arg.untyped_storage()._cdata)
                if name is not None:
                    self.trace.first_use.setdefault(name, self.ops)
        for pos in _MATMUL_OPERANDS.get(func._schema.name, ()):
            if pos < len(args) and isinstance(args[pos], torch.Tensor):
                name = self.storage_to_name.get(args[pos].untyped_storage()._cdata)
                if name is not None:
                    self.trace.matmul_params.add(name)
        return func(*args, **(kwargs or {}))


class FusedAttentionStandIn(torch.autograd.Function):
    """Shape-only attention that saves what fused (flash-style) kernels keep for backward,
    and allocates in backward what they allocate (the meta trace and the dry run use it).

    Saved: query, key, value (key/value at their own head count), the output and
    a float32 log-sum-exp per head and query token, as PyTorch's fused SDPA kernels
    (flash on CPU and CUDA, memory-efficient on CUDA) save them. The ``T x T`` score matrix is
    not kept: fused kernels recompute it in backward.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (batch, tokens, heads, dim) memory, seen as (batch, heads, tokens, dim): the layout
        # fused kernels return, so the caller's transpose back is free, as with them.
        b, h, t, _ = q.shape
        out = q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # what a fused backward allocates: dq, dk, dv and an fp32 dq accumulator
        q, k, v, _out, _lse = ctx.saved_tensors
        accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del accum
        return dq, dk, dv


def fused_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' ``AttentionInterface``: the output of
    :class:`FusedAttentionStandIn` in the ``(batch, tokens, heads, dim)`` layout, no weights."""
    out = FusedAttentionStandIn.apply(query, key, value)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def _trace_attention(model: nn.Module) -> Iterator[None]:
    """Route attention through :func:`fused_attention` for the duration of the trace."""
    from transformers import AttentionInterface

    AttentionInterface.register(_FUSED_ATTENTION, fused_attention)
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if config is not None:
        config._attn_implementation = _FUSED_ATTENTION
    try:
        yield
    finally:
        if config is not None:
            config._attn_implementation = previous


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta stand-in for a parameter: bf16 when floating point, as the engine computes."""
    dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
    return torch.empty_like(t, device="meta", dtype=dtype)


def _trace(model: nn.Module, blocks: nn.ModuleList, context: int = TRACE_CONTEXT) -> _Trace:
    """Run forward + loss on meta stand-ins (bf16) for batch 1 x ``context`` tokens, with
    attention through the fused stand-in (what a flash kernel saves for backward); a
    model whose forward branches on its attention implementation's name and cannot run
    the stand-in is traced with its own implementation instead (an upper bound)."""
    limit = model_context(getattr(model, "config", None))
    if limit is not None:  # a short-context model traces at most its context
        context = min(context, limit)
    try:
        return _trace_once(model, blocks, context, fused=True)
    except Exception:  # the model's forward rejects the stand-in: trace it as it is
        return _trace_once(model, blocks, context, fused=False)


def _trace_once(model: nn.Module, blocks: nn.ModuleList, context: int, *, fused: bool) -> _Trace:
    if activation_checkpointing(model):
        raise ValueError(
            f"{type(model).__name__} has activation (gradient) checkpointing enabled, which "
            "hides the activations a block saves for backward: disable it (e.g. "
            "model.gradient_checkpointing_disable()) before profiling or finding its parts"
        )
    trace = _Trace(tokens=context, fused=fused)
    params = dict(model.named_parameters())
    # what autograd saves depends on what is trained: a frozen matrix (LoRA's base) keeps
    # no input for its weight gradient; a model with nothing trained yet is traced as
    # fully trained
    trained = {n for n, p in params.items() if p.requires_grad} or set(params)
    stand_ins: dict[str, torch.Tensor] = {n: _meta_like(p) for n, p in params.items()}
    stand_ins.update({n: torch.empty_like(b, device="meta") for n, b in model.named_buffers()})
    storage_to_name = {stand_ins[n].untyped_storage()._cdata: n for n in params}
    const_storages = {t.untyped_storage()._cdata for t in stand_ins.values()}

    recorder = _Recorder(storage_to_name, trace)
    current: list[int | None] = [None]
    seen: list[set[Any]] = [set() for _ in blocks]  # storages, and views as swapped
    trace.saved_bytes, trace.swapped_bytes = [0] * len(blocks), [0] * len(blocks)
    trace.block_spans = [(0, 0)] * len(blocks)

    def pack(t: torch.Tensor) -> torch.Tensor:
        i = current[0]
        if i is not None:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in const_storages and key not in seen[i]:
                seen[i].add(key)
                trace.saved_bytes[i] += storage.nbytes()
            # each view at its own bytes, as SavedActivations.pack stores it
            view = (key, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            broadcast = any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True))
            stored = t.is_floating_point() and t.numel() > 0 and not broadcast
            if stored and key not in const_storages and view not in seen[i]:
                seen[i].add(view)
                trace.swapped_bytes[i] += t.numel() * t.element_size()
        return t

    handles = []
    for i, block in enumerate(blocks):

        def pre(_m: nn.Module, a: Any, kw: Any, i: int = i) -> None:
            current[0] = i
            trace.block_args.setdefault(i, (tuple(a), dict(kw)))
            trace.calls.append(i)
            trace.block_spans[i] = (recorder.ops, recorder.ops)

        def post(_m: nn.Module, _a: Any, _o: Any, i: int = i) -> None:
            current[0] = None
            trace.block_spans[i] = (trace.block_spans[i][0], recorder.ops)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post))

    ids = torch.zeros((1, context), dtype=torch.long, device="meta")
    was_training = model.training
    model.train()
    try:
        with (
            no_pad_token(model),
            _trace_attention(model) if fused else contextlib.nullcontext(),
            recorder,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            stand_ins_req = {
                n: t.requires_grad_(True) if n in trained and t.is_floating_point() else t
                for n, t in stand_ins.items()
            }
            torch.func.functional_call(
                model, stand_ins_req, (), {"input_ids": ids, "labels": ids}, strict=False
            )
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return trace


def _find_parts(model: nn.Module) -> tuple[ModelParts, _Trace, nn.ModuleList]:
    blocks_path, blocks = find_block_list(model)
    trace = _trace(model, blocks)
    _check_block_calls(model, blocks_path, len(blocks), trace.calls)
    names = {id(p): n for n, p in model.named_parameters()}

    embedding = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    embed_ids = {id(p) for p in embedding.parameters()}
    tied = head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", 0)
    block_params = tuple(tuple(names[id(p)] for p in block.parameters()) for block in blocks)
    in_blocks = {n for group in block_params for n in group}
    head_names = (
        tuple(names[id(p)] for p in head.parameters() if id(p) not in embed_ids)
        if head is not None
        else ()
    )
    start = min(s for s, _ in trace.block_spans)
    end = max(e for _, e in trace.block_spans)
    embed: list[str] = [names[i] for i in embed_ids]
    final: list[str] = []
    unused: list[str] = []
    for name in names.values():
        if name in in_blocks or name in head_names or name in embed:
            continue
        used = trace.first_use.get(name)
        if used is None:
            unused.append(name)
        elif used <= start:
            embed.append(name)
        elif used > end:
            final.append(name)
        else:
            raise ValueError(
                f"parameter {name!r} of {type(model).__name__} is outside the block list "
                f"{blocks_path!r} but first used between its blocks, so it belongs to neither "
                "the embedding side nor the final side: move it into the blocks"
            )
    parts = ModelParts(
        blocks_path=blocks_path,
        block_names=tuple(f"{blocks_path}.{i}" for i in range(len(blocks))),
        block_param_names=block_params,
        embed_param_names=tuple(embed),
        final_param_names=tuple(final),
        head_param_names=head_names,
        unused_param_names=tuple(unused),
        input_embedding=_module_path(model, embedding),
        output_head=_module_path(model, head) if head is not None else None,
        tied_embeddings=bool(tied),
    )
    return parts, trace, blocks


def _check_block_calls(model: nn.Module, path: str, count: int, calls: list[int]) -> None:
    """Refuse a model whose forward does not run each block once, in order: the pager
    streams the blocks as a sequence, one page-in per block per pass (a model that loops
    over some of its blocks, or skips them, would compute with the wrong or no weights)."""
    if calls == list(range(count)):
        return
    runs = {i: calls.count(i) for i in range(count)}
    twice = sorted(i for i, n in runs.items() if n > 1)
    never = sorted(i for i, n in runs.items() if n == 0)
    how = (
        f"runs blocks {twice} more than once" if twice
        else f"never runs blocks {never}" if never
        else f"runs them in the order {calls}"
    )  # fmt: skip
    raise ValueError(
        f"{type(model).__name__} {how} of its {count} blocks ({path!r}) in one forward: "
        "balance_beam pages each block once per pass, in order; train and generate this "
        "model without balance_beam"
    )


def check_block_calls(model: nn.Module) -> None:
    """Refuse, with one ``ValueError`` line, a model whose forward does not run each of
    its blocks once, in order (a model looping over some of its layers). Runs the meta
    trace (:func:`_trace`) over 8 tokens: no memory, no arithmetic, the model unchanged; a
    forward that meta stand-ins cannot run to its end (one reading a tensor's value) is
    not checked."""
    path, blocks = find_block_list(model)
    try:
        trace = _trace(model, blocks, context=8)
    except Exception:  # only a forward run to its end can tell: never refuse on a guess
        return
    _check_block_calls(model, path, len(blocks), trace.calls)


def find_parts(model: nn.Module) -> ModelParts:
    """Find the embedding side, repeated blocks, final side and head of a causal LM.

    Runs one forward on the meta device with meta stand-ins for the parameters; the
    model itself is not changed. Raises ``ValueError`` when no repeated block list
    exists.
    """
    return _find_parts(model)[0]


def profile_fields_from_module(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments of ``ModelProfile`` for ``model`` (counts in parameters, bytes)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"{type(model).__name__} has no .config: pass a Hugging Face causal LM "
            "(an AutoModelForCausalLM instance)"
        )
    parts, trace, blocks = _find_parts(model)
    params = dict(model.named_parameters())

    def total(group: tuple[str, ...]) -> int:
        return sum(params[n].numel() for n in group)

    # Blocks may differ (the dense first layers of an MoE model): the largest one stands
    # for all of them, so memory and transfers are never under-priced.
    widest = max(range(len(blocks)), key=lambda i: (total(parts.block_param_names[i]), -i))
    first, block_name = parts.block_param_names[widest], parts.block_names[widest]
    hidden = config_int(config, "hidden_size")
    num_heads = config_int(config, "num_heads", default=0)  # 0: no attention (Mamba)
    kv_heads = config_int(config, "num_kv_heads", default=num_heads)
    head_dim = config_int(config, "head_dim", default=hidden // num_heads if num_heads else 0)
    act_full = -(-max(trace.saved_bytes) // trace.tokens)
    act_swapped = -(-max(trace.swapped_bytes) // trace.tokens)
    act_backward = _backward_bytes_per_token(model, trace, widest, block_name, act_full)
    matmul = tuple(n for n in first if n in trace.matmul_params)
    experts, top_k, expert_names = _experts(config, model.get_submodule(block_name))
    return {
        "name": str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")),
        "num_blocks": len(blocks),
        "hidden_size": hidden,
        "num_heads": num_heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(model.get_input_embeddings().weight.shape[0]),  # type: ignore[operator]
        "max_positions": config_int(config, "context", default=0),
        "block_params": total(first),
        "block_matmul_params": total(matmul),
        "embed_params": total(parts.embed_param_names),
        "head_params": total(parts.head_param_names),
        "final_params": total(parts.final_param_names) + total(parts.unused_param_names),
        "tied_embeddings": parts.tied_embeddings,
        "act_bytes_per_token_checkpointed": hidden * 2,
        "act_bytes_per_token_full": act_full,
        "act_bytes_per_token_backward": act_backward,
        "act_bytes_per_token_swapped": act_swapped,
        "kv_bytes_per_token": 2 * kv_heads * head_dim * 2,
        "num_experts": experts,
        "experts_per_token": top_k,
        "block_expert_params": total(
            tuple(n for n in matmul if n.removeprefix(block_name + ".") in expert_names)
        ),
    }


def _backward_bytes_per_token(
    model: nn.Module, trace: _Trace, index: int, block_name: str, act_full: int
) -> int:
    """Bytes per token block ``index``'s backward holds beyond what its forward saved
    (:func:`~bb_lightning.hf.backward_trace.backward_workspace_bytes` of the call the trace
    made); ``act_full`` (a backward as large as the forward's saved set) when the block
    cannot be run alone."""
    from bb_lightning.hf.backward_trace import backward_workspace_bytes

    call = trace.block_args.get(index)
    if call is None:
        return act_full
    try:
        with _trace_attention(model) if trace.fused else contextlib.nullcontext():
            extra = backward_workspace_bytes(model.get_submodule(block_name), *call)
    except Exception:  # a block that needs more than its traced call: the upper bound
        return act_full
    return -(-extra // trace.tokens)


def _experts(config: Any, block: nn.Module) -> tuple[int, int, set[str]]:
    """(experts per block, experts per token, names in ``block`` of the routed experts'
    parameters); (0, 0, empty) for a dense block.

    Expert weights are found by shape, not name: a parameter whose leading dimension is
    the number of experts (fused ``[experts, out, in]`` weights), or any parameter inside
    an ``nn.ModuleList`` of that many same-typed modules (one module per expert).
    """
    n = config_value(config, "num_experts") or 0
    k = config_value(config, "experts_per_token") or 0
    if n < 2 or not 1 <= k <= n:
        return 0, 0, set()
    names = {name for name, p in block.named_parameters() if p.dim() >= 3 and p.shape[0] == n}
    for path, module in block.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            if len({type(child) for child in module}) == 1:
                names.update(f"{path}.{name}" for name, _ in module.named_parameters())
    if not names:
        return 0, 0, set()
    return n, k, names


def load_config(config: Any) -> Any:
    """A ``PretrainedConfig`` from a config, a dict with ``model_type``, a config.json
    path, a model directory or a hub id (needs network); see
    :func:`bb_lightning.engine.hf_quirks.resolve_model`."""
    return resolve_model(config).config


def _check_causal_lm(cfg: Any) -> None:
    """Raise ``ValueError`` (one line) unless ``AutoModelForCausalLM`` can build ``cfg``."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = getattr(cfg, "model_type", "") or type(cfg).__name__
        raise ValueError(
            f"config of model_type {kind!r} ({type(cfg).__name__}) has no causal-LM class in "
            "transformers' AutoModelForCausalLM: pass the config of a decoder-only causal LM "
            "(e.g. llama, mistral, qwen2, gpt2, opt)"
        )


def profile_fields_from_config(config: Any) -> dict[str, Any]:
    """Keyword arguments of ``ModelProfile`` for the model ``config`` describes (meta build)."""
    from transformers import AutoModelForCausalLM

    from bb_lightning.hf.hf_load import unbuildable

    cfg = load_config(config)
    _check_causal_lm(cfg)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as err:
        raise unbuildable(cfg, err) from None
    return profile_fields_from_module(model)
