"""The engine: one loop owns the model and serves queued requests, one room per job.

loop.py       the thread, the inbox (submit / cancel / load) and `step()`; every phase's guard
request.py    `Request` with typed `Options`, `Load`, `EngineError`
admission.py  the waiting room: per-tenant lines, bounds, weighted fair order
scheduler.py  who runs and which tokens each feeds this step (no tensors); preemption victims
intake.py     `SequenceFactory`: a waiting request's packed-path state, or its way to serial.py
slots.py      each running sequence's KV slots over the prefix cache (reserve, commit, complete)
sequence.py   a request on the packed path: tokens, slots, output state
model_runner.py  a step's packed forward (`StepForward`); serial.py the one-request path
attention/    packed attention over the pool: the batch, one module per strategy, dispatch, probes
speculative.py   draft/verify rounds inside the packed forward; postprocess.py logits to pieces
report.py     metrics and trace spans; batch.py `BatchEngine`, the loop with the packed runner
"""
