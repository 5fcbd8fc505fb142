#!/usr/bin/env bash
# The mutation check: each mutation breaks one core property in the working tree, runs the
# tests that prove it, then restores the file (git checkout). Every line must say
# "caught" (pytest failed). Run from the repository root with a clean tree of these files:
#   bash tests/mutations.sh        (about 3 minutes on 2 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
status=0

mutate() {  # name file old new tests...
  local name=$1 file=$2 old=$3 new=$4 rc start
  shift 4
  if ! git diff --quiet -- "$file"; then
    echo "$name: $file has uncommitted changes; not mutated" >&2; status=1; return
  fi
  "$py" - "$file" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert text.count(old) == 1, (path, old)
open(path, "w").write(text.replace(old, new))
PY
  start=$(date +%s)
  "$py" -m pytest -q "$@" > "/tmp/zerojax-mutation-$name.log" 2>&1
  rc=$?
  git checkout -- "$file"
  if [ "$rc" -ne 0 ]; then
    echo "$name: caught ($(( $(date +%s) - start )) s): $(tail -n 1 "/tmp/zerojax-mutation-$name.log")"
  else
    echo "$name: NOT caught: the tests pass with the property broken"; status=1
  fi
}

# fp32 reductions: differentiate the bf16 params themselves (stages 2-3 then reduce in bf16).
mutate fp32_reduction zerojax/step.py \
  "p32 = jax.tree.map(lambda p: p.astype(reduce_dtype), params)" "p32 = params" \
  tests/test_zero.py::test_gradient_reductions_are_fp32_with_bf16_params
# Bit-exact resume: a restore that loses the Kahan compensation.
mutate exact_resume zerojax/checkpoint/__init__.py \
  "    return jax.tree.unflatten(jax.tree.structure(target), leaves), meta" \
  "    leaves = [jax.numpy.zeros_like(x) if 'compensation' in k else x
              for k, x in zip(wanted, leaves)]
    return jax.tree.unflatten(jax.tree.structure(target), leaves), meta" \
  tests/test_checkpoint.py::test_exact_resume
# Release = the normal step: release's gradient mean off by 1e-4.
mutate release_is_normal zerojax/release.py \
  "mean_scale = jnp.asarray(1.0 / plan.num_data, reduce_dtype)" \
  "mean_scale = jnp.asarray((1.0 + 1e-4) / plan.num_data, reduce_dtype)" \
  tests/test_release.py::test_release_step_equals_the_normal_step
# Offload = no offload: what comes back from host memory is one bf16 ulp off (optimizer
# state, then parameters), every float leaf: bf16's numpy kind is 'V', so the kind test
# this once used ('f') mutated only the fp32 leaves and no bf16 case could catch it.
OFFLOADED="lambda x, m: jax.device_put((x.astype(jax.numpy.float32) * (1 + 2**-7)).astype(x.dtype)
  if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and space == jax.memory.Space.Device
  else x, space) if m and x.size else x"
mutate optimizer_offload zerojax/streaming/memory.py \
  "lambda x, m: jax.device_put(x, space) if m and x.size else x" "$OFFLOADED" \
  tests/test_offload.py::test_offloaded_step_equals_the_normal_step
mutate param_offload zerojax/streaming/memory.py \
  "lambda x, m: jax.device_put(x, space) if m and x.size else x" "$OFFLOADED" \
  tests/test_param_offload.py::test_offloaded_params_train_bit_for_bit_as_params_on_the_device
# The peer watch's refusal: a hello whose proof is wrong is believed.
mutate peer_watch_refusal zerojax/run/peers.py \
  "if not hmac.compare_digest(proof, _proof(watch.secret, nonce, pid)):" \
  "if not (lambda a, b: True)(proof, _proof(watch.secret, nonce, pid)):" \
  tests/test_protections.py::test_the_peer_watch_believes_only_a_hello_that_proves_the_secret \
  tests/test_multihost.py::test_strangers_do_not_stop_the_run_and_a_hung_process_stops_every_process
# Written behind = written in its own trip: the pending update goes to the layer it is
# written in (i), not the one it belongs to (i+1).
mutate write_behind zerojax/release.py \
  "before, written = jnp.maximum(i - 1, 0), jnp.minimum(i + 1, depth - 1)" \
  "before, written = jnp.maximum(i - 1, 0), i" \
  tests/test_param_offload.py::test_written_behind_is_the_same_step_bit_for_bit
# Writes first = reads first: the config's order never reaches the step (the carried
# update then sits beside the backward: more temporaries on XLA's GPU compiler).
mutate writes_first zerojax/build.py \
  "writes_first=c.optimizer.release_writes_first)" "writes_first=False)" \
  tests/test_param_offload.py::test_on_a_gpu_written_behind_the_copies_run_under_the_matmuls
# Stage 3 on XLA:CPU (issue 30's abort): the head's gather no longer waits for the layer
# loop's (zerojax.stage3.after does nothing): the sweep's first run aborts (exit -6: 9 s
# and 72 s in two tries).
mutate stage3_order zerojax/stage3.py \
  "  deps = [d for d in jax.tree.leaves(deps) if d.size]" \
  "  return tree" \
  tests/test_stage3_sweep.py
exit $status
