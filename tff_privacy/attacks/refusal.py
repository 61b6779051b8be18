"""The one way an attack declines: it cannot read the uploads it is given."""

import contextlib


class UploadRefused(ValueError):
  """An attack cannot read these uploads: their kind, their model's task,
  the number of examples behind them, an optimizer whose steps hide the
  gradient, or a store without the metadata the attack reads. The same
  records are refused on every try, so a refusal is a result (the
  leaderboard keeps it), unlike a failure such as running out of memory,
  which another try may not meet."""


@contextlib.contextmanager
def refusing_unreadable(attack: str, record, declaration: str):
  """Runs what attack `attack` reads of `record`'s public configuration for
  its `declaration` (e.g. 'upload_mask', 'region_prior'), turning the
  `KeyError` or `ValueError` of a store it cannot read (one captured by an
  older version, without a field the attack needs) into `UploadRefused`
  naming the declaration and the reason: the same store is refused on
  every try."""
  where = (f"attack {attack!r} refuses round {record.round_num} client "
           f"{record.client_index}: its {declaration} cannot read its store")
  try:
    yield
  except UploadRefused:
    raise
  except KeyError as e:
    lacks = f"has no {e.args[0]!r}" if e.args else "lacks a field it reads"
    raise UploadRefused(f"{where}, whose metadata {lacks} (captured by an "
                        "older version?)") from None
  except ValueError as e:
    reason = (str(e).splitlines() or [""])[0]
    raise UploadRefused(f"{where}: {reason}") from None
