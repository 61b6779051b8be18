"""Declared parameters, and the flags, checks and errors derived from them."""

import pytest

from tff_privacy import algorithms, attacks, defenses, runner
from tff_privacy.params import REQUIRED, Param, Params

CLIP = Param("clip", float, help="clip", minimum=0, exclusive_minimum=True)
P = Param("p", float, 0.5, "fraction", minimum=0, maximum=1, exclusive_maximum=True)
STEPS = Param("steps", int, 5, "steps", minimum=0)
NORM = Param("norm", str, "l2", "norm", choices=("l1", "l2"))


@pytest.mark.parametrize("param,value,message", [
    (CLIP, 0, "clip must be > 0, got 0.0"),
    (P, 1.0, "p must lie in [0, 1), got 1.0"),
    (P, -0.1, "p must lie in [0, 1), got -0.1"),
    (STEPS, -1, "steps must be >= 0, got -1"),
    (STEPS, 2.5, "steps must be an integer >= 0, got 2.5"),
    (STEPS, "3", "steps must be an integer >= 0, got '3'"),
    (STEPS, True, "steps must be an integer >= 0, got True"),
    (NORM, "linf", "norm='linf'; choose one of 'l1', 'l2'"),
    (CLIP, "big", "clip must be a finite number > 0, got 'big'"),
    (CLIP, float("nan"), "clip must be a finite number > 0, got nan"),
    (CLIP, float("inf"), "clip must be a finite number > 0, got inf"),
    (STEPS, float("inf"), "steps must be an integer >= 0, got inf"),
    (STEPS, 10 ** 400, None),
])
def test_bad_values_name_the_parameter_and_what_it_accepts(param, value, message):
  if message is None:  # a valid value
    assert param.check(value) == value
    return
  with pytest.raises(ValueError) as error:
    param.check(value)
  assert str(error.value) == message


def test_values_are_converted_to_the_declared_kind():
  assert CLIP.check(2) == 2.0 and isinstance(CLIP.check(2), float)
  assert STEPS.check(3.0) == 3 and isinstance(STEPS.check(3.0), int)
  assert P.check(0) == 0.0


def test_resolve_fills_defaults_and_refuses_unknown_or_missing():
  params = Params(CLIP, P, STEPS)
  assert params.resolve("defense 'x'", {"clip": 1}) == {"clip": 1.0, "p": 0.5,
                                                        "steps": 5}
  with pytest.raises(ValueError, match="defense 'x' takes no nope; its "
                     "parameters: clip, p, steps"):
    params.resolve("defense 'x'", {"clip": 1, "nope": 2})
  with pytest.raises(ValueError, match="defense 'x' needs clip"):
    params.resolve("defense 'x'", {})
  with pytest.raises(ValueError, match=r"defense 'x': p must lie in \[0, 1\)"):
    params.resolve("defense 'x'", {"clip": 1, "p": 2})
  assert CLIP.required and CLIP.default is REQUIRED


def test_a_default_must_satisfy_its_own_range():
  with pytest.raises(ValueError, match="must be > 0"):
    Param("lr", float, 0.0, minimum=0, exclusive_minimum=True)


def _all_components():
  for name, method in algorithms.METHODS.items():
    yield "method", name, method.parameters
  for name, cls in defenses.DEFENSES.items():
    yield "defense", name, cls.PARAMETERS
  for name, cls in attacks.ATTACKS.items():
    yield "attack", name, cls.PARAMETERS


def test_every_parameter_has_help():
  for kind, name, params in _all_components():
    for p in params:
      assert p.help, f"{kind} {name}: {p.name} has no help"


def test_the_cli_offers_a_flag_for_every_declared_parameter():
  from tff_privacy import cli
  train = cli._parser()._subparsers._group_actions[0].choices["train"]
  attack = cli._parser()._subparsers._group_actions[0].choices["attack"]
  flags = {opt for parser in (train, attack) for action in parser._actions
           for opt in action.option_strings}
  for kind, name, params in _all_components():
    for p in params:
      if p.cli:
        assert "--" + p.flag in flags, f"{kind} {name}: --{p.flag} missing"
  for p in runner.RUN_PARAMETERS:
    assert "--" + p.flag in flags


def test_constructors_check_through_the_declaration():
  with pytest.raises(ValueError, match=r"p must lie in \[0, 1\), got 1.5"):
    defenses.Sparsification(1.5)
  with pytest.raises(ValueError, match="iterations must be >= 1, got 0"):
    attacks.InvertingGradients(iterations=0)
  with pytest.raises(ValueError, match="attack 'dlg' takes no tv_weight"):
    attacks.DLG(tv_weight=0.1)


def test_object_parameters_are_checked_by_their_parse_function():
  def pair(value):
    if not (isinstance(value, list) and len(value) == 2):
      raise ValueError(f"pair must be a list of two, got {value!r}")
    return value
  p = Param("pair", object, None, "two things", cli=False, parse=pair)
  assert Params(p).resolve("x", {"pair": [1, "a"]}) == {"pair": [1, "a"]}
  with pytest.raises(ValueError, match=r"^x: pair must be a list of two, got 3$"):
    Params(p).resolve("x", {"pair": 3})
  for bad in (dict(kind=object), dict(kind=object, parse=pair, cli=True),
              dict(kind=str, parse=pair, cli=False)):
    with pytest.raises(TypeError, match="kind object goes with parse"):
      Param("pair", **bad)
