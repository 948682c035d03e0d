"""What batch-invariant attention costs: one SmolLM2 decode / verify forward with the engine's
paged-attention op (``new``) against the per-request torch SDPA loop it replaced (``old``, the
same gather through the block table, then SDPA with the bottom-right mask), interleaved in one
process; prints the median and min of 12 runs per case (ms) and new/old.

    python benchmarks/paged_attention_ab.py [bfloat16|float32]
"""
import sys, time, statistics, torch, torch.nn.functional as F
import specmesh.engine.model as em
from specmesh.engine.loader import load_model
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner, SeqChunk
torch.set_num_threads(2)
dt = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
loaded = load_model(None, dtype=dt)
m, cfg = loaded.model, loaded.config
bs = 16
cache = KVCache(cfg, 400, bs, dtype=dt)
runner = ModelRunner(m, cfg, cache)
new_pa = em.paged_attention

def old_pa(q, kb, vb, tables, q_lens, kv_lens, scale, plan=None, cpu_kernel=True):
    out = torch.empty_like(q); off = 0
    H, Hkv = q.shape[1], kb.shape[2]
    for t, ql, n in zip(tables, q_lens, kv_lens):
        tt = torch.tensor(t[: -(-n // bs)])
        k = kb.index_select(0, tt).flatten(0, 1)[:n]; v = vb.index_select(0, tt).flatten(0, 1)[:n]
        mask = None if ql == 1 else (torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None])
        o = F.scaled_dot_product_attention(q[off:off+ql].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
        out[off:off+ql] = o.transpose(0, 1); off += ql
    return out

def run(ctx, q_len, batch):
    chunks = [SeqChunk([100 + i] * q_len, ctx, list(range(i * 140, i * 140 + 140))) for i in range(batch)]
    runner.forward(chunks, logits="last")

res = {}
for ctx, q_len, batch in [(128, 1, 1), (128, 5, 1), (512, 1, 1), (512, 5, 1), (2048, 1, 1), (2048, 5, 1), (200, 5, 2)]:
    for name, fn in (("old", old_pa), ("new", new_pa)):
        em.paged_attention = fn; run(ctx, q_len, batch)
    ts = {"old": [], "new": []}
    for _ in range(12):
        for name, fn in (("old", old_pa), ("new", new_pa)):
            em.paged_attention = fn
            t = time.perf_counter(); run(ctx, q_len, batch); ts[name].append(time.perf_counter() - t)
    o, n = (statistics.median(ts[k]) * 1e3 for k in ("old", "new"))
    print(f"{dt} ctx {ctx:5d} q_len {q_len} batch {batch}: old {o:6.1f} ms  new {n:6.1f} ms  new/old {n/o:.2f}  (min {min(ts['old'])*1e3:.1f} / {min(ts['new'])*1e3:.1f})", flush=True)
