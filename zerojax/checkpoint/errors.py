"""What can go wrong with a checkpoint, as exceptions (train.py: exit 2, or 6 for a save)."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be used: incompatible with the run, or unreadable."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint whose files are missing, unreadable or fail their checksums."""


class SaveError(RuntimeError):
  """A checkpoint that could not be written (disk full, no permission, ...)."""
