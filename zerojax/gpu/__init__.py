"""GPU targets: the train step compiled by XLA's GPU compiler for a named GPU, no GPU needed.

    python -m zerojax.memory --config configs/70b_8x80gb.py --target h100:8 --compile
    python train.py --config configs/70b_8x80gb.py --dry_run --target h100:8
    python -m zerojax.memory.fit --config configs/70b_bf16.py   # which GPUs can run it

`targets` names the GPUs (one `specs/<name>.txtpb` each) and judges what fits;
`compile` runs the compile (`compat`: the JAX internals it needs, guarded); `xla_flags`:
train.py's XLA flag profile for a GPU; `host_link`: each target's host link. Nothing is
allocated and no kernel runs: the numbers are XLA's GPU buffer assignment, the same
program a GPU would run. Needs JAX's CUDA plugin (the `gpu-compile` extra), not a driver.

Which backend a trace is for (`backend()`, `targeting()`) is `zerojax.runtime.platform`,
below the models that ask it. This room imports the models (a layer's bytes for the
flag profile), the config and the runtime; the planner (`zerojax.memory`) imports it.
"""
