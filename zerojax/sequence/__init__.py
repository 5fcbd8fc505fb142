"""Sequence parallelism: one sequence split over the ZeRO devices, attention by all-to-all.

The sequence room (Ulysses sequence parallelism). It imports no other zerojax room.

With `mesh.sequence_parallel`, each device of an 'fsdp' group holds a slice of every
sequence of its examples (`T / fsdp` positions) instead of whole examples: embeddings,
norms, the MLP and the loss run on the slice; attention switches to the whole sequence
for `H / fsdp` of the heads by one all-to-all of q, k and v, and back by one of its
output (Ulysses, `ulysses.attention`). The batch is split over 'data' only.

Why over the ZeRO axis rather than a new 'sequence' mesh axis: ZeRO's state stays
sharded over every device (a separate axis would replicate it over the sequence
devices, as DeepSpeed's ALST avoids by running Ulysses and ZeRO-3 over the same GPUs),
and the gradients need nothing new: each device's gradient of its slice's loss is a
partial sum, and the stage's reductions already sum over 'fsdp'. Why Ulysses rather
than ring attention: the Llama shapes split evenly by heads (the 70B: 64 query and 8
KV heads over 8 devices: 8 and 1 a device), each device then runs the ordinary kernels
(blocked or cuDNN's) on a whole sequence, and each of q, k, v and the output crosses
the links once ((n - 1) / n of a device's slice leaves it) instead of a ring's n - 1
rounds of K/V blocks. When there are fewer KV heads
than devices, each is repeated so that every device gets whole KV heads for its query
heads (`ulysses.kv_repeats`).

Packing: a row's 'positions' and 'segment_ids' are split with its tokens, so an example
crossing a slice boundary keeps its RoPE angles; attention sees the whole row's segment
ids (an int32 all-gather, `T` x 4 bytes).
"""

from zerojax.sequence.batch import inputs_and_targets, shard_batch, split_tokens
from zerojax.sequence.ulysses import attention, kv_repeats

__all__ = ["attention", "inputs_and_targets", "kv_repeats", "shard_batch", "split_tokens"]
