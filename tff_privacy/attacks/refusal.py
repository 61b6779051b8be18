"""The one way an attack declines: it cannot read the uploads it is given."""


class UploadRefused(ValueError):
  """An attack cannot read these uploads: their kind, their model's task,
  the number of examples behind them, or an optimizer whose steps hide the
  gradient. The same records are refused on every try, so a refusal is a
  result (the leaderboard keeps it), unlike a failure such as running out
  of memory, which another try may not meet."""
