"""The local schedule of a round: which batches a client steps through.

One definition serves both sides: the runner cuts each client's data into
these batches, and an attacker who simulates the client's local steps cuts
its dummy data the same way, so a simulated upload can equal the real one.

Each local epoch is one pass over the client's N samples in batches of B,
the last batch of an epoch holding the N mod B left over (batches never span
two epochs, as in McMahan et al.'s ClientUpdate). A one-batch round (FedSGD)
is a single batch of min(N, B) samples.
"""

from __future__ import annotations


def local_batch_sizes(num_examples: int, batch_size: int,
                      local_epochs: int = 1, one_batch: bool = False) -> list[int]:
  """Sizes of the batches a client steps through in one round, in order.

  Args:
    num_examples: N, the client's distinct samples this round (>= 1).
    batch_size: B (>= 1).
    local_epochs: passes over the N samples (>= 1); ignored with `one_batch`.
    one_batch: a single batch of min(N, B) samples (FedSGD).

  Returns:
    The batch sizes, e.g. N=10, B=4, 2 epochs: [4, 4, 2, 4, 4, 2].

  Raises:
    ValueError: if an argument is below 1.
  """
  for name, value in (("num_examples", num_examples), ("batch_size", batch_size),
                      ("local_epochs", local_epochs)):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  if one_batch:
    return [min(num_examples, batch_size)]
  full, rest = divmod(num_examples, batch_size)
  epoch = [batch_size] * full + ([rest] if rest else [])
  return epoch * local_epochs
