"""The run room: what a training run needs around its step, across processes and time.

`distributed`: `jax.distributed` from the cluster's environment, with errors a person can
act on; `peers`: the authenticated peer watch (a dead or stuck process ends every
process); `watchdog`: the hang watchdog; `preemption`: SIGTERM as a final checkpoint;
`workdir`: a run's directory and its lock; `launch`: `zerojax-launch`, N local processes
as a multi-host run; `metrics`: the metrics line, MFU, TensorBoard and W&B writers.

Imports the runtime and the config rooms only (tests/test_imports.py has the layers).
"""
