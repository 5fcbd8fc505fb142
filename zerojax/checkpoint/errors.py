"""What can go wrong with a checkpoint, as exceptions (train.py: exit 2; 6 for a save, 8
for a restore that failed for another reason than damage)."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be used: incompatible with the run, or unreadable."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint whose files show damage: missing, truncated or undecodable files, a state
  tree that is not its meta's, failed checksums (`zerojax.checkpoint.damage`)."""


class SaveError(RuntimeError):
  """A checkpoint that could not be written (disk full, no permission, ...)."""


class RestoreError(RuntimeError):
  """A checkpoint whose restore failed though its files show no damage (out of memory,
  an I/O error, a bug): it is left as it is, for a rerun once the cause is fixed."""
