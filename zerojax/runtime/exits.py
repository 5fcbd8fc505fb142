"""The exit statuses of zerojax's commands: one table, so job runners can act on them.

A job runner that restarts on failure should restart on `STOPPED` (the run saved and
wants to go on), on `HUNG` (the stacks printed say where it stuck) and on `PEER_LOST` /
`SAVE_FAILED` / `RESTORE_FAILED` once the cause is fixed; it should
not restart on `BAD_INPUT` or `NON_FINITE`, which fail the same way again.

| status | name | meaning |
| --- | --- | --- |
| 0 | `DONE` | finished (or already finished); a dry run that compiled |
| 1 | — | an unexpected error (a bug): Python's traceback |
| 2 | `BAD_INPUT` | unusable input: config, command line, data, checkpoint, HF folder (a) |
| 3 | `NON_FINITE` | `precision.max_consecutive_skips` non-finite steps in a row |
| 4 | `INIT_FAILED` | the processes of a multi-host run did not all join in time |
| 5 | `PEER_LOST` | another process of the run died or a collective failed |
| 6 | `SAVE_FAILED` | a checkpoint could not be written (disk full, permission) |
| 7 | `HUNG` | a process made no progress within `train.step_timeout` (every process) |
| 8 | `RESTORE_FAILED` | a checkpoint whose files show no damage could not be read (c) |
| 75 | `STOPPED` | saved and stopped before the last step (b); the same command resumes |

(a) Also: the workdir is locked by another run; the step does not fit the host's memory.
(b) SIGTERM, Ctrl-C or `--stop_after`. 75 is sysexits' EX_TEMPFAIL: "try again".
(c) Out of host memory, an I/O error (a flaky network mount), a bug: the line names the
    cause and the checkpoint, which is left as it is. A damaged checkpoint is not this:
    it is moved aside and the one before resumes (zerojax/checkpoint).
"""

DONE = 0
BAD_INPUT = 2
NON_FINITE = 3
INIT_FAILED = 4
PEER_LOST = 5
SAVE_FAILED = 6
HUNG = 7
RESTORE_FAILED = 8
STOPPED = 75
