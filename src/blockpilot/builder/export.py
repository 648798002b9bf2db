"""ONNX export of the target and the drafter with static-capacity KV caches as graph inputs/outputs.

`models/` knows nothing about ONNX; the flat-signature wrappers here call its modules and fix
the graph contract that onnxruntime, TensorRT and the tests share (`GraphSpec`). Shapes:
`b` batch, `T` query tokens, `L` logit rows, `cap` cache capacity, `n` new context positions,
`K` block size, `H` hidden, `tH` taps x H, `V` vocab, `nkv`/`hd` KV heads and head dim.

Target graph (`target.onnx`):
    inputs   input_ids (b, T) int64, positions (b, T) int64 (contiguous in each row), logits_index (L,) int64,
             past_key_i / past_value_i (b, nkv, cap, hd) for every layer i
    outputs  logits (b, L, V) at rows `logits_index` of the T queries, taps (b, T, tH),
             hidden (b, T, H) after the final norm, present_key_i / present_value_i
The query at `positions[r, t]` attends over every cache index <= it in row r (the whole capacity is in the
graph; stale entries beyond the positions are masked out). New K/V are written at `positions`.

Drafter graph (`drafter.onnx`): embedding, DFlash layers, the target's lm_head and argmax. With a
draft vocabulary (`draft_vocab_ids`) the graph holds only those N rows of lm_head and the ids as
initializers, and maps the argmax back to target ids, so its outputs are the same either way.
    inputs   last_token (b, 1) int64, block_positions (b, K) int64, context_taps (b, n, tH),
             context_positions (b, n) int64 (contiguous in each row; n >= 1: the decode loop always
             commits at least one token), context_length (b, 1) int64,
             past_key_i / past_value_i (b, nkv, cap, hd) of the drafter's context cache
    outputs  draft_ids (b, K - 1) int64 (greedy, block slots 1..K-1), draft_logits (b, K - 1, N) float (the
             logits those argmaxes came from, over the N draft-vocabulary rows: the proposal that sampled
             requests draw their drafts from), present_key_i / present_value_i
The block `[last_token, MASK x (K - 1)]` of row r sees cache indices < context_length[r] and itself.
Rows are independent: one call can carry requests at different positions (a batch).

Cache writes: present = past with the new K/V at the write positions, exported as ONNX
`TensorScatter` (opset 24, write index per row = its first position; onnxruntime and TensorRT >= 10.15
update it in place) or `ScatterND` (opset 18, any TensorRT 10; attention is then MatMul/Softmax).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from blockpilot.models.decoder import Decoder, KVCache
from blockpilot.models.dflash import DFlashDrafter, draft_logits, logits_draft_tokens
from blockpilot.models.layers import rope_for_heads, write_cache

SUPPORTED_OPSETS = (18, 24)
TARGET_INPUTS = ("input_ids", "positions", "logits_index")
TARGET_OUTPUTS = ("logits", "taps", "hidden")
DRAFTER_INPUTS = ("last_token", "block_positions", "context_taps", "context_positions", "context_length")
DRAFTER_OUTPUTS = ("draft_ids", "draft_logits")


def cache_names(num_layers: int, prefix: str) -> list[str]:
    """`[prefix_key_0, prefix_value_0, prefix_key_1, ...]`: the order caches travel in."""
    return [f"{prefix}_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """I/O contract of one exported graph (tensor names in graph order)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    num_cache_layers: int

    @property
    def past_names(self) -> list[str]:
        return cache_names(self.num_cache_layers, "past")

    @property
    def present_names(self) -> list[str]:
        return cache_names(self.num_cache_layers, "present")

    def to_dict(self) -> dict:
        return {"inputs": list(self.inputs), "outputs": list(self.outputs),
                "num_cache_layers": self.num_cache_layers}

    @classmethod
    def from_dict(cls, raw: dict) -> "GraphSpec":
        return cls(tuple(raw["inputs"]), tuple(raw["outputs"]), int(raw["num_cache_layers"]))


def target_spec(num_layers: int) -> GraphSpec:
    return GraphSpec(TARGET_INPUTS + tuple(cache_names(num_layers, "past")),
                     TARGET_OUTPUTS + tuple(cache_names(num_layers, "present")), num_layers)


def drafter_spec(num_layers: int) -> GraphSpec:
    return GraphSpec(DRAFTER_INPUTS + tuple(cache_names(num_layers, "past")),
                     DRAFTER_OUTPUTS + tuple(cache_names(num_layers, "present")), num_layers)


class TargetGraph(nn.Module):
    """Flat-signature target: `(input_ids, positions, logits_index, *past) -> (logits, taps, hidden, *present)`."""

    def __init__(self, target: Decoder, tap_layers: tuple[int, ...]):
        super().__init__()
        self.target = target
        self.tap_layers = tuple(tap_layers)

    def forward(self, input_ids, positions, logits_index, *past):
        t = self.target
        # The decoder writes its cache in place; writing into copies makes the update functional.
        cache = KVCache(k=[p.clone() for p in past[0::2]], v=[p.clone() for p in past[1::2]])
        out = t(t.embed_tokens(input_ids), positions, cache, past[0].shape[2], self.tap_layers)
        logits = t.lm_head(out.hidden[:, logits_index])  # (b, L, V)
        present = [c for pair in zip(cache.k, cache.v) for c in pair]
        return (logits, out.taps, out.hidden, *present)


class DrafterGraph(nn.Module):
    """Flat-signature drafter: `(last_token, block_positions, context_taps, context_positions,
    context_length, *past) -> (draft_ids, draft_logits, *present)`; mirrors `DFlashDrafter.forward` with the
    cache slice replaced by a mask over the full capacity."""

    def __init__(self, target: Decoder, drafter: DFlashDrafter):
        super().__init__()
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head
        self.drafter = drafter
        self.mask_token_id = drafter.config.mask_token_id
        # (N, H) rows of lm_head for a draft vocabulary (an initializer of its own); None: lm_head itself
        reduced = drafter.draft_vocab_ids is not None
        self.register_buffer("draft_head", drafter.draft_head_weight(target.lm_head.weight) if reduced else None)

    def forward(self, last_token, block_positions, context_taps, context_positions, context_length, *past):
        d = self.drafter
        b, k_block = block_positions.shape
        x = d.block_embeddings(self.embed_tokens(last_token), self.embed_tokens.weight[self.mask_token_id], k_block)
        context = d.hidden_norm(d.fc(context_taps))  # (b, n, H)
        ctx_rope = rope_for_heads(d.rope(context_positions, x.dtype))
        block_rope = rope_for_heads(d.rope(block_positions, x.dtype))
        capacity = past[0].shape[2]
        visible = torch.cat((torch.arange(capacity, device=x.device)[None, :] < context_length,
                             torch.ones_like(block_positions, dtype=torch.bool)), dim=1)  # (b, cap + K)
        mask = visible[:, None, None, :].expand(-1, 1, k_block, -1)  # (b, 1, K, cap + K): one row per query
        present = []
        for i, layer in enumerate(d.layers):
            k_new, v_new = layer.context_kv(context, ctx_rope)  # (b, nkv, n, hd) each
            k_ctx = write_cache(past[2 * i].clone(), context_positions, k_new)
            v_ctx = write_cache(past[2 * i + 1].clone(), context_positions, v_new)
            x = layer(x, k_ctx, v_ctx, block_rope, mask)
            present += [k_ctx, v_ctx]
        head = self.lm_head.weight if self.draft_head is None else self.draft_head
        logits = draft_logits(d.norm(x)[:, 1:], head)  # (b, K - 1, N)
        draft_ids = logits_draft_tokens(logits, d.draft_vocab_ids)  # (b, K - 1) target ids
        return (draft_ids, logits, *present)


def _check_cache_axis(dim: int) -> None:
    if dim != 2:  # the only scatter in the graphs is the cache write along the sequence axis
        raise NotImplementedError(f"scatter along axis {dim} has no translation; only cache writes (axis 2)")


def _kv_write_translation(opset: int):
    """onnxscript translation of `aten.scatter(cache, 2, index, values)` for `opset`: the cache write
    of `models.layers.write_cache` with per-row positions, `index` = positions `(b, T)` expanded
    to `(b, nkv, T, hd)`.

    Both forms write `values` `(b, nkv, T, hd)` into `cache` `(b, nkv, cap, hd)` along axis 2
    without transposing the cache (so a runtime may bind present and past to one buffer).
    TensorScatter writes row r at `positions[r, 0]` onward: positions must be contiguous per row.
    """
    if opset >= 24:
        from onnxscript.onnx_opset import opset24 as op24

        def tensor_scatter_write(cache, dim: int, index, values):
            _check_cache_axis(dim)
            zero = op24.Constant(value_int=0)
            start = op24.Gather(op24.Gather(op24.Gather(index, zero, axis=1), zero, axis=1), zero, axis=1)  # (b,)
            return op24.TensorScatter(cache, values, start, axis=2)

        return tensor_scatter_write
    from onnxscript import opset18 as op18

    def scatter_nd_write(cache, dim: int, index, values):
        shape = op18.Shape(values)  # [b, nkv, T, hd]
        _check_cache_axis(dim)
        lead = op18.Slice(shape, op18.Constant(value_ints=[0]), op18.Constant(value_ints=[3]))  # [b, nkv, T]
        index_shape = op18.Concat(lead, op18.Constant(value_ints=[1]), axis=0)  # [b, nkv, T, 1]
        zero, one = op18.Constant(value_int=0), op18.Constant(value_int=1)
        batch = op18.Range(zero, op18.Gather(shape, 0), one)
        heads = op18.Range(zero, op18.Gather(shape, 1), one)
        b = op18.Expand(op18.Reshape(batch, op18.Constant(value_ints=[-1, 1, 1, 1])), index_shape)
        h = op18.Expand(op18.Reshape(heads, op18.Constant(value_ints=[1, -1, 1, 1])), index_shape)
        t = op18.Slice(index, op18.Constant(value_ints=[0]), op18.Constant(value_ints=[1]),
                       op18.Constant(value_ints=[3]))  # (b, nkv, T, 1) positions
        return op18.ScatterND(cache, op18.Concat(b, h, t, axis=-1), values)  # indices (b, nkv, T, 3)

    return scatter_nd_write


@dataclasses.dataclass(frozen=True)
class ExportLimits:
    """Ranges of the dynamic dimensions the graphs accept."""

    max_seq_len: int  # largest capacity, positions < max_seq_len
    max_batch: int = 64


def _export(module: nn.Module, args: tuple, spec: GraphSpec, dynamic_shapes: tuple, path: Path,
            opset: int, external_data: bool) -> Path:
    import logging
    import warnings

    if opset not in SUPPORTED_OPSETS:
        raise ValueError(f"opset {opset} not in {SUPPORTED_OPSETS}")
    # The exporter logs one warning per torchvision op it cannot register; they do not concern us.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter deprecation chatter
        program = torch.onnx.export(
            module.eval(), args, dynamo=True, opset_version=opset, dynamic_shapes=dynamic_shapes,
            input_names=list(spec.inputs), output_names=list(spec.outputs), verbose=False,
            custom_translation_table={torch.ops.aten.scatter.src: _kv_write_translation(opset)},
        )
    program.save(str(path), external_data=external_data)
    return path


def _dims(limits: ExportLimits) -> dict[str, torch.export.Dim]:
    s = limits.max_seq_len
    return {
        "batch": torch.export.Dim("batch", min=1, max=limits.max_batch),
        "query": torch.export.Dim("query_len", min=1, max=s),
        "rows": torch.export.Dim("logit_rows", min=1, max=s),
        "capacity": torch.export.Dim("capacity", min=2, max=s),
        "block": torch.export.Dim("block_size", min=2, max=s),
        "context": torch.export.Dim("context_len", min=1, max=s),
    }


@torch.no_grad()
def export_target(target: Decoder, tap_layers: tuple[int, ...], path: Path, limits: ExportLimits,
                  opset: int = 24, external_data: bool = False) -> GraphSpec:
    """Write the target graph to `path` (weights in `path.data` when `external_data`).

    Args:
        target: the decoder, in the dtype the graph should have; its RoPE table must cover
            `limits.max_seq_len` positions.
        tap_layers: layers whose outputs are concatenated into `taps` (the drafter's context).
        path: the `.onnx` file to write.
        limits: dynamic dimension ranges.
        opset: 24 (TensorScatter, Attention) or 18 (ScatterND, MatMul/Softmax).
        external_data: store weights beside the graph (needed above 2 GB).

    Returns:
        The graph's I/O contract.
    """
    c, dims = target.config, _dims(limits)
    spec = target_spec(c.num_hidden_layers)
    dtype = target.embed_tokens.weight.dtype
    batch, query, capacity = 2, 3, min(8, limits.max_seq_len)  # >1 so export keeps them symbolic
    past = tuple(torch.zeros(batch, c.num_key_value_heads, capacity, c.head_dim, dtype=dtype)
                 for _ in spec.past_names)
    positions = torch.arange(query).expand(batch, query).contiguous()
    args = (torch.zeros(batch, query, dtype=torch.long), positions, torch.arange(2), *past)
    cache_dims = tuple({0: dims["batch"], 2: dims["capacity"]} for _ in past)
    rows = {0: dims["batch"], 1: dims["query"]}
    dynamic = (rows, rows, {0: dims["rows"]}, cache_dims)
    _export(TargetGraph(target, tap_layers), args, spec, dynamic, path, opset, external_data)
    return spec


@torch.no_grad()
def export_drafter(target: Decoder, drafter: DFlashDrafter, path: Path, limits: ExportLimits,
                   opset: int = 24, external_data: bool = False) -> GraphSpec:
    """Write the drafter graph (with the target's embedding and lm_head) to `path`.

    Args/Returns: as `export_target`; `drafter` must have the target's dtype.
    """
    c, dims = drafter.config.layers, _dims(limits)
    spec = drafter_spec(c.num_hidden_layers)
    dtype = target.embed_tokens.weight.dtype
    batch, block, context, capacity = 2, 4, 3, min(16, limits.max_seq_len)
    taps_width = len(drafter.config.target_layer_ids) * c.hidden_size
    past = tuple(torch.zeros(batch, c.num_key_value_heads, capacity, c.head_dim, dtype=dtype)
                 for _ in spec.past_names)
    def rows(values: torch.Tensor) -> torch.Tensor:
        return values.expand(batch, -1).contiguous()

    args = (torch.zeros(batch, 1, dtype=torch.long), rows(torch.arange(context, context + block)),
            torch.zeros(batch, context, taps_width, dtype=dtype), rows(torch.arange(context)),
            rows(torch.tensor([context])), *past)
    cache_dims = tuple({0: dims["batch"], 2: dims["capacity"]} for _ in past)
    per_row = {0: dims["batch"]}
    dynamic = (per_row, {**per_row, 1: dims["block"]}, {**per_row, 1: dims["context"]},
               {**per_row, 1: dims["context"]}, per_row, cache_dims)
    _export(DrafterGraph(target, drafter), args, spec, dynamic, path, opset, external_data)
    return spec
