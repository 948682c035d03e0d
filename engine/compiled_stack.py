"""The decoder layers of a float32 GGUF model as one compiled call per forward
(``specmesh_decoder_layers_f32`` in ``kernels/cpu_layer_ops.cpp``).

Why: on the CPU a decode or verify step of SmolLM2 runs about 14 kernel calls per layer (norms,
products, RoPE, K/V writes, attention, SiLU), each behind a few Python and torch dispatches, which
cost a large share of a one-token forward (docs/benchmarks.md, 'Compiled kernels'). The compiled
loop calls the same kernels in the same order with the same arguments, so its logits equal the
layer-by-layer path's bit for bit (tests/engine/test_engine_compiled_stack.py), and it keeps that
path's batch invariance.

It runs when every part of a layer has a compiled kernel: float32 CPU inference (no autograd),
every linear layer on GGUF blocks (engine/gguf_weights.py) without biases, a paged KV cache
(float32, or bfloat16 / float16: K/V rounded into it as ``KVCache.write`` rounds them) attended
through a plan (decode, verify, chunked prefill: whole prompts keep SDPA), the CPU attention
kernel in use, and the model's CPU backend (engine/backend.py) with ``compiled_stack`` on.
Otherwise the model runs layer by layer.
"""

from __future__ import annotations

import ctypes

import torch

from specmesh.engine.kv_cache import KVCache
from specmesh.kernels import cpu_attention, gguf_matmul, layer_ops
from specmesh.kernels.paged_attention import attention_runs_compiled
from specmesh.kernels.paged_attention_plan import check_block_ids

_FORMATS = {"Q4_1": 0, "Q8_0": 1}


class _Product(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int64), ("scale", ctypes.c_void_p), ("minv", ctypes.c_void_p),
                ("qs", ctypes.c_void_p), ("n", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qkv", _Product),
                ("o", _Product), ("gate_up", _Product), ("down", _Product),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Plan(ctypes.Structure):
    _fields_ = [("block_tables", ctypes.c_void_p), ("table_width", ctypes.c_int64),
                ("token_batch", ctypes.c_void_p), ("token_visible", ctypes.c_void_p),
                ("token_path", ctypes.c_void_p), ("path_width", ctypes.c_int64),
                ("token_chunk_start", ctypes.c_void_p), ("block_size", ctypes.c_int64)]



def _product(blocks) -> _Product:  # noqa: ANN001 - a kernels.gguf_matmul.BlockWeight
    scale, minv, qs = blocks._ptrs
    return _Product(_FORMATS[blocks.fmt], scale, minv or None, qs, blocks.out_features)


class CompiledStack:
    """Runs a :class:`engine.model.LlamaForCausalLM`'s decoder layers as one compiled call.
    Built once per model; the per-layer pointers are rebuilt whenever a layer's blocks or the
    cache change (a changed weight drops its blocks: the model then runs layer by layer)."""

    def __init__(self, model) -> None:  # noqa: ANN001 - engine.model.LlamaForCausalLM
        self.model = model
        self._watched: tuple | None = None  # see _watch
        self._layers = None
        self._keep: list = []  # tensors the pointers point into

    def enabled(self) -> bool:
        """Whether the model's backend runs the compiled stack (``compiled_stack`` on)."""
        return self.model.backend.compiled_stack.on

    def _blocks(self, x: torch.Tensor) -> list[tuple] | None:
        """Per layer the (qkv, o, gate_up, down) blocks for input ``x``, or None where any
        layer lacks one or has a bias."""
        out = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if any(lin.bias is not None for lin in (attn.q_proj, attn.k_proj, attn.v_proj,
                                                    attn.o_proj)):
                return None
            parts = (attn._qkv.blocks_for(x), attn.o_proj.blocks_for(x),
                     mlp._gate_up.blocks_for(x), mlp.down_proj.blocks_for(x))
            if any(p is None or p.fmt not in _FORMATS for p in parts):
                return None
            out.append(parts)
        return out

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta,  # noqa: ANN001
            kv_cache, capture_layers: tuple[int, ...] | None = None) -> dict[int, torch.Tensor] | None:
        """Every decoder layer over ``h`` [T, hidden] (float32, updated in place to the last
        layer's output), writing the batch's K/V into ``kv_cache``; ``cos`` / ``sin``
        [T, 1, head_dim]; ``meta`` an :class:`engine.attention_metadata.AttentionMetadata` with its plan.

        Returns the captured layer outputs {layer: [T, hidden]} (empty without
        ``capture_layers``), or None when the compiled call does not apply (nothing was
        computed or written then).

        Raises:
            IndexError: a slot outside the cache. ValueError: a block id outside it.
            RuntimeError: a product failed (out of memory).
        """
        plan = getattr(meta, "_plan", None)
        if h.dtype is not torch.float32 or not h.is_cpu or h.dim() != 2 or plan is None \
                or not isinstance(kv_cache, KVCache) or not self.enabled() \
                or kv_cache.dtype not in layer_ops.KV_KINDS \
                or not attention_runs_compiled(h, self.model.backend.cpu_attention.on,
                                               kv_dtype=kv_cache.dtype):
            return None
        # unchanged since the pointers were built, the per-layer checks of _blocks (a large
        # share of the call's overhead) need not run again (the grad check is per call)
        if torch.is_grad_enabled() or not self._unchanged(kv_cache):
            blocks = self._blocks(h)
            if blocks is None:
                self._watched = None
                return None
            self._build(blocks, kv_cache)
            self._watched = None if torch.is_grad_enabled() else self._watch(kv_cache)
        config = self.model.config
        t = h.shape[0]
        slots = meta.slot_mapping
        if slots.numel() != t:
            raise ValueError(f"{slots.numel()} slots for {t} tokens")
        if int(slots.min()) < 0 or int(slots.max()) >= kv_cache.num_slots:
            raise IndexError(f"slots outside [0, {kv_cache.num_slots})")
        check_block_ids(plan, kv_cache.num_blocks)
        tables = plan.block_tables.contiguous()
        path, start = plan.token_path, plan.token_chunk_start
        c_plan = _Plan(tables.data_ptr(), tables.shape[1], plan.token_batch.data_ptr(),
                       plan.token_visible.data_ptr(),
                       None if path is None else path.data_ptr(),
                       0 if path is None else path.shape[1],
                       None if start is None else start.data_ptr(), kv_cache.block_size)
        captured = {i: torch.empty_like(h) for i in capture_layers or ()}
        num_layers = config.num_layers
        capture = None
        if captured:
            capture = (ctypes.c_void_p * num_layers)(
                *[captured[i].data_ptr() if i in captured else None for i in range(num_layers)])
        cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
        rc = layer_ops.KERNEL.lib.specmesh_decoder_layers_f32(
            h.data_ptr(), t, config.hidden_size, ctypes.addressof(self._layers), num_layers,
            None if capture is None else ctypes.addressof(capture),
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), config.num_heads,
            config.num_kv_heads, config.head_dim, config.intermediate_size,
            self.model.model.norm.variance_epsilon, config.head_dim ** -0.5,
            ctypes.addressof(c_plan), *self._entries(kv_cache.dtype),
            layer_ops.KV_KINDS[kv_cache.dtype], torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"the compiled decoder layers failed (code {rc})")
        return captured

    @staticmethod
    def _entries(kv_dtype: torch.dtype) -> tuple[int, int, int]:
        glib, alib = gguf_matmul.KERNEL.lib, cpu_attention.library()
        attention = getattr(alib, cpu_attention.entry_name(torch.float32, kv_dtype))
        return (ctypes.cast(glib.specmesh_q4_1_matmul, ctypes.c_void_p).value,
                ctypes.cast(glib.specmesh_q8_0_matmul, ctypes.c_void_p).value,
                ctypes.cast(attention, ctypes.c_void_p).value)

    def _watch(self, kv_cache: KVCache) -> tuple:
        """What the pointers are built from, held so :meth:`_unchanged` can compare it without
        ``nn.Module`` attribute lookups: the cache's storage; per linear layer its parameter
        dict, weight (object, storage, version), bias and blocks; per RMSNorm its weight."""
        linears = [(lin._parameters, lin, lin.weight, lin.weight.data_ptr(),
                    lin.weight._version, lin.bias, lin._blocks) for lin in self._linears()]
        norms = [(norm._parameters, norm.weight, norm.weight.data_ptr())
                 for layer in self.model.model.layers
                 for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        return kv_cache.data.data_ptr(), linears, norms

    def _unchanged(self, kv_cache: KVCache) -> bool:
        """Whether nothing the pointers were built from changed, read through held references
        (reading the same state through module attributes cost many times more)."""
        watched = self._watched
        if watched is None or kv_cache.data.data_ptr() != watched[0]:
            return False
        for params, lin, weight, ptr, version, bias, blocks in watched[1]:
            if params["weight"] is not weight or weight._version != version \
                    or weight.data_ptr() != ptr or params["bias"] is not bias \
                    or lin._blocks is not blocks:
                return False
        return all(params["weight"] is weight and weight.data_ptr() == ptr
                   for params, weight, ptr in watched[2])

    def _linears(self) -> list:
        """Every linear layer of the decoder layers (q, k, v, o, gate, up, down of each)."""
        return [lin for layer in self.model.model.layers
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                            layer.self_attn.v_proj, layer.self_attn.o_proj,
                            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]

    def _build(self, blocks: list[tuple], kv_cache: KVCache) -> None:
        layers = self.model.model.layers
        arr = (_Layer * len(layers))()
        self._keep = []
        for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(layers, blocks)):
            ln1 = layer.input_layernorm.weight.detach().contiguous()
            ln2 = layer.post_attention_layernorm.weight.detach().contiguous()
            k, v = kv_cache.data[i, 0], kv_cache.data[i, 1]
            self._keep += [ln1, ln2, qkv, o, gate_up, down]
            arr[i] = _Layer(ln1.data_ptr(), ln2.data_ptr(), _product(qkv), _product(o),
                            _product(gate_up), _product(down), k.data_ptr(), v.data_ptr())
        self._layers = arr

__all__ = ["CompiledStack"]
