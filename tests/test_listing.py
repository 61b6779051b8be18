"""The built-in grids come from the listings that methods and defenses
declare, a user's own included."""

import pytest

from tff_privacy import defenses
from tff_privacy.disclosure import Disclosure
from tff_privacy.leaderboard import defaults, grid
from tff_privacy.listing import Listing
from tff_privacy.params import Param, Params

# the compact grid as it was written out by hand before the listings:
# (name, method, defense, its one strength)
COMPACT = {
    ("FedSGD", "fedsgd", None, None), ("HyperFL", "hyperfl", None, None),
    ("FedRE", "fedre", None, 50.0), ("RECUP-FL", "fedsgd", "recupfl", 0.001),
    ("FedAvg", "fedavg", None, None), ("DP-FedAvg", "fedavg", "dp_fedavg", 1.0),
    ("FedEM", "fedem", None, 8 / 255), ("LDP-Fed", "fedsgd", "ldp_fed", 1.0),
    ("Soteria", "fedsgd", "soteria", 0.8),
    ("Sparsification", "fedsgd", "sparsification", 0.9),
    ("LDP Laplace", "fedsgd", "ldp_laplace", 0.1),
    ("LDP Gaussian", "fedsgd", "ldp_gaussian", 0.1), ("DP clip", "fedsgd", "dp_clip", 1.0)}


def _shape(entry):
  strengths = list(entry.get("sweep", {None: [None]}).values())[0]
  return entry["name"], entry["method"], entry.get("defense"), strengths[0]


def test_the_compact_grid_lists_every_entry_of_before_with_the_reference_first():
  entries = defaults.grid("compact")["entries"]
  assert {_shape(e) for e in entries} == COMPACT and len(entries) == len(COMPACT)
  assert entries[0]["name"] == "FedSGD"
  # a defense runs under its method with that method's own listed parameters
  recup = next(e for e in entries if e["name"] == "RECUP-FL")
  assert recup["method_kwargs"] == {"server_learning_rate": 0.2}
  assert recup["defense_kwargs"]["zoo_size"] == 5
  full = {e["name"]: e for e in defaults.grid("full")["entries"]}
  assert full["RECUP-FL"]["defense_kwargs"]["zoo_size"] == 20
  assert full["LDP Gaussian"]["sweep"] == {"noise_multiplier": [0.001, 0.01, 0.1, 1.0]}
  assert {"pFedHN", "DP-SGD FedAvg"} <= set(full)
  assert "pFedHN" not in {e["name"] for e in entries}


@pytest.fixture
def quantization():
  @defenses.register
  class Quantize(defenses.UpdateDefense):
    name = "quantize_for_test"
    PARAMETERS = Params(Param("bits", int, 4, "bits per entry", minimum=1))
    DISCLOSURE = Disclosure(no_adaptive_attack="a test's")
    LISTING = Listing("Quantize", "bits", 4, (2, 4, 8), method="fedavg",
                      seconds=1e6)

    def apply(self, update, seed, client=None):
      return list(update)

  yield Quantize
  defenses.DEFENSES.unregister(Quantize.name)


def test_a_registered_defenses_listing_puts_it_on_every_built_in_grid(quantization):
  for scale in defaults.SCALES:
    entries = defaults.grid(scale)["entries"]
    # the slowest after the reference
    assert [e["name"] for e in entries[:2]] == ["FedSGD", "Quantize"]
    assert entries[1]["method_kwargs"] == {"client_learning_rate": 0.05}
    want = [2, 4, 8] if scale == "full" else [4]
    assert entries[1]["sweep"] == {"bits": want} and entries[1]["default"] == 4
    grid.parse(defaults.grid(scale))  # a valid grid


def test_a_listing_states_its_strength_whole_and_its_label_once(quantization):
  with pytest.raises(ValueError, match="give parameter and default together"):
    Listing("X", parameter="bits")
  with pytest.raises(ValueError, match="full_sweep needs the swept parameter"):
    Listing("X", full_sweep=(1, 2))
  with pytest.raises(ValueError, match=r"scales \['huge'\]"):
    Listing("X", scales=("huge",))

  @defenses.register
  class Heir(quantization):  # inherits the listing: not listed twice
    name = "heir_for_test"

  @defenses.register
  class Twin(quantization):
    name = "twin_for_test"
    LISTING = quantization.LISTING

  try:
    with pytest.raises(ValueError, match=r"listings share the labels \['Quantize'\]"):
      defaults.grid("compact")
    defenses.DEFENSES.unregister(Twin.name)
    names = [e["name"] for e in defaults.grid("compact")["entries"]]
    assert names.count("Quantize") == 1
  finally:
    for cls in (Heir, Twin):
      defenses.DEFENSES.unregister(cls.name)
