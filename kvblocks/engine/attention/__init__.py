"""Packed attention over the KV pool: many requests in one forward, K/V read through slot lists.

A packed forward (`PackedForward`) runs the new tokens of every request as one sequence `[1, T]`,
each token at its own position, so the linear layers see every request's rows at once. Attention
is the one place where requests stay apart: `dispatch.paged_attention`, registered with
transformers' `AttentionInterface`, writes each layer's new K/V into the pool at the new tokens'
slots and reads each request's keys through its slot list, the shared prefix's slots included,
exactly as the trie holds them. Nothing is copied per request between steps.

batch.py        `Segment` (one request's share) and `PackedBatch` (the layout every layer reads)
strategy.py     the attention strategy, chosen once from the configuration (`choose`)
per_segment.py  a call per segment (batch-invariant where the fixed cuts' probe fails; windows, soft-caps)
grouped.py      short segments padded into one call per layer (the CUDA default)
cascade.py      shared runs read in place, own keys batched, merged by log-sum-exp (the CPU default)
fixed_cuts.py   the batch-invariant cascade: keys cut at fixed positions (`--batch-invariant` on CPU)
direct.py       the CPU kernel (`kvblocks.engine.kernel`) for narrow segments, keys read in place
fused.py        the fused attention call with log-sum-exps and the exact merge
dispatch.py     the attention function transformers calls: packed batch or the model's own
probes.py       what batch invariance relies on, checked on the device and dtype before use
forward.py      `PackedForward`: packed forwards of one model over one pool
"""
