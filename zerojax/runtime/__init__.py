"""The runtime room: what every other room may ask of the process it runs in.

`platform`: which backend the step being traced is for (`backend()`, `targeting()`);
`device_env`: a child's environment for fake CPU devices, the one writer of XLA's
device-count flag, importing no JAX (the launcher's); `devices`: this process's fake CPU
devices; `jax_internals`:
the private JAX calls we need, each guarded in one place; `xla_dump`: reading what XLA
dumps (buffer assignments, live bytes at the peak); `exits`: the exit statuses of every
command; `units`: bytes as people write them.

The lowest layer: it imports no other zerojax room (tests/test_imports.py).
"""
