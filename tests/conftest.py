"""Test setup: 8 fake CPU devices, set before JAX starts a backend."""

from zerojax.devices import fake_cpu_devices

# Without the XLA:CPU memory flags: the tests compile faster with XLA's default scheduler.
fake_cpu_devices(8, memory_flags=False)
