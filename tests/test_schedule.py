"""`streaming.schedule`'s timing of a scheduled module, on hand-written HLO: each number
below is worked out from the module's FLOPs and bytes (the GPU-compiled schedules are
test_param_offload's)."""

import pytest

from zerojax.streaming import schedule

# One matmul of 2 x 512 x 1024 x 1024 FLOPs and one host copy of 2 MiB each way per trip:
# at these rates each takes exactly 1 ms.
FLOPS = 2 * 512 * 1024 * 1024
RATE, LINK = FLOPS / 1e-3, 2 * 1024 * 1024 / 1e-3
TRIPS = 4

READ_START = ("  %read-start = ((bf16[4,1048576]{1,0:S(5)}, s32[], s32[]), bf16[1,1048576]{1,0}, "
              "u32[]) fusion-start(%stack, %i, %zero), kind=kLoop, calls=%slice")
READ_DONE = "  %read-done = bf16[1,1048576]{1,0} fusion-done(%read-start)"
WRITE_START = ("  %write-start = ((bf16[4,1048576]{1,0:S(5)}, bf16[1,1048576]{1,0}, s32[], s32[]), "
               "bf16[4,1048576]{1,0:S(5)}, u32[]) fusion-start(%stack, %row, %i, %zero), "
               "kind=kLoop, calls=%update")
WRITE_DONE = "  %write-done = bf16[4,1048576]{1,0:S(5)} fusion-done(%write-start)"
GEMM = ("  %gemm_fusion = bf16[512,1024]{1,0} fusion(%x, %w), kind=kCustom, "
        "calls=%gemm_computation")


def module(*body: str) -> str:
  """A scheduled module: a while loop of TRIPS trips whose body runs `body` in order."""
  return "\n".join([
      "HloModule m, is_scheduled=true",
      "",
      "%gemm_computation (p0: bf16[512,1024], p1: bf16[1024,1024]) -> bf16[512,1024] {",
      "  %p0 = bf16[512,1024]{1,0} parameter(0)",
      "  %p1 = bf16[1024,1024]{1,0} parameter(1)",
      "  ROOT %dot = bf16[512,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, "
      "rhs_contracting_dims={0}",
      "}",
      "",
      "%body (param: (s32[], bf16[4,1048576])) -> (s32[], bf16[4,1048576]) {",
      "  %param = (s32[], bf16[4,1048576]{1,0:S(5)}) parameter(0)",
      *body,
      "  ROOT %out = (s32[], bf16[4,1048576]{1,0:S(5)}) tuple(%i, %stack)",
      "}",
      "",
      "ENTRY %main (a: (s32[], bf16[4,1048576])) -> (s32[], bf16[4,1048576]) {",
      "  %a = (s32[], bf16[4,1048576]{1,0:S(5)}) parameter(0)",
      "  ROOT %while = (s32[], bf16[4,1048576]{1,0:S(5)}) while(%a), condition=%cond, "
      f'body=%body, backend_config={{"known_trip_count":{{"n":"{TRIPS}"}}}}',
      "}",
  ])


def test_the_matmuls_flops_are_counted_through_their_fusion():
  flops, _ = schedule.computation_flops(module(GEMM))
  assert flops["gemm_fusion"] == flops["dot"] == FLOPS


@pytest.mark.parametrize("body, trip, waits", [
    # The read in flight over the matmul: the trip is the matmul's 1 ms.
    ((READ_START, GEMM, READ_DONE), 1e-3, 0.0),
    # Started after it: the stream waits the copy's whole 1 ms.
    ((GEMM, READ_START, READ_DONE), 2e-3, 1e-3),
    # A read and a write over one matmul: full duplex, both hidden.
    ((READ_START, WRITE_START, GEMM, READ_DONE, WRITE_DONE), 1e-3, 0.0),
    # The write may start only after the read is done (as an in-place write into the
    # stack it reads): the read under the matmul, the write waited for.
    ((READ_START, GEMM, READ_DONE, WRITE_START, WRITE_DONE), 2e-3, 1e-3),
])
def test_a_trip_waits_for_the_copies_nothing_runs_under(body, trip, waits):
  text = module(*body)
  (loop,) = schedule.timed_loops(text, RATE, LINK)
  copies = 1e-3 * sum(line in body for line in (READ_START, WRITE_START))
  assert loop.runs == TRIPS
  assert loop.compute == pytest.approx(1e-3)
  assert loop.copies == pytest.approx(copies)
  assert loop.trip == pytest.approx(trip)
  assert loop.exposed == pytest.approx(waits, abs=1e-12)
  assert schedule.timed_step(text, RATE, LINK) == pytest.approx((TRIPS * copies, TRIPS * waits),
                                                                abs=1e-12)


def test_copies_on_one_direction_queue_on_the_link():
  """Two reads started together share one direction: the second arrives after 2 ms, the
  matmul covers 1 ms of it."""
  second = (READ_START.replace("read-start", "read2-start"),
            READ_DONE.replace("read-done", "read2-done").replace("read-start", "read2-start"))
  (loop,) = schedule.timed_loops(
      module(READ_START, second[0], GEMM, READ_DONE, second[1]), RATE, LINK)
  assert loop.trip == pytest.approx(2e-3)
  assert loop.hidden == pytest.approx(0.5)


def test_the_line_says_how_much_is_hidden():
  line = schedule.timed_line(4e-3, 1e-3, RATE, LINK)
  assert "75% of it under compute" in line and "waits 1.0 ms" in line, line
