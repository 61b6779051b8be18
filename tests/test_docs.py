"""Every code block of the README, of the documentation site's pages
(docs/) and of the docstrings its API reference shows runs, or is checked
as the program it names would check it:

* `python`: run as a script in a fresh interpreter, in an empty folder
  (slow: they train), and where the page goes on "prints `X`", X is in
  what it printed; a block that only includes a file (`--8<-- "PATH"`,
  pymdownx.snippets) is that file, which the test named in `INCLUDED` runs;
* `sh`: `bash -n`, then each command: `tff-privacy SUB ...` through the
  CLI's own parser, and `train` on to its RunConfig (every check a run
  makes before training; nothing trains); `python FILE ...`: FILE exists
  and takes every flag given, and the scripts in `RUN` run; `make T`: a target of the Makefile; other
  programs (ssh) only by `bash -n`;
* `json`: parsed; `toml`: parsed, and an entry-point group it names is one
  of the registries';
* `text`: output and file layouts, not code.

The tables of docs/threat-model.md are checked against the registries.
"""

import ast
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from tff_privacy import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md")]
               + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
LANGUAGES = ("python", "sh", "json", "toml", "text")
# scripts a shell block runs for real, since a later command reads what they
# write (seconds each)
RUN = {"experiments/write_split.py"}
# a file a page includes whole, and the test that runs it
INCLUDED = {"examples/own_defense.py": "tests/test_examples.py"}
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def code_blocks(path):
  """(language, code, line, after) of each fenced block of the page at
  `path`; `after`: the paragraph that follows it."""
  with open(path) as f:
    return fenced_blocks(f.read())


def fenced_blocks(text):
  """(language, code, line, after) of each fenced block of Markdown `text`."""
  blocks, lines = [], text.split("\n")
  i = 0
  while i < len(lines):
    opened = FENCE.match(lines[i])
    if not opened:
      i += 1
      continue
    indent, language = opened.groups()
    end = next(j for j in range(i + 1, len(lines))
               if lines[j].strip() == "```" and lines[j].startswith(indent))
    code = "\n".join(line[len(indent):] for line in lines[i + 1:end])
    after = "\n".join(lines[end + 1:]).strip().split("\n\n")[0]
    blocks.append((language, code, i + 1, after))
    i = end + 1
  return blocks


def docstring_blocks():
  """The fenced blocks of the package's docstrings, which the API
  reference shows: (file, line, language, code, after)."""
  found = []
  for path in sorted(glob.glob(os.path.join(ROOT, "tff_privacy", "**", "*.py"),
                               recursive=True)):
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
        doc = ast.get_docstring(node)
        for language, code, line, after in fenced_blocks(doc or ""):
          found.append((os.path.relpath(path, ROOT), node.body[0].lineno + line - 1,
                        language, code, after))
  return found


BLOCKS = [(os.path.relpath(page, ROOT), line, language, code, after)
          for page in PAGES for language, code, line, after in code_blocks(page)
          ] + docstring_blocks()


def blocks_of(*languages):
  return [pytest.param(language, code, id=f"{page}:{line}")
          for page, line, language, code, _ in BLOCKS if language in languages]


def test_the_pages_have_blocks_of_known_languages_only():
  assert len(BLOCKS) > 20  # the pages were found and read
  unknown = [f"{page}:{line}: {language or 'none'}"
             for page, line, language, _, _ in BLOCKS if language not in LANGUAGES]
  assert not unknown, f"give each block one of {LANGUAGES}: {unknown}"


@pytest.mark.parametrize("language, code", blocks_of("text"))
def test_text_blocks_hold_no_command_or_code(language, code):
  first = code.strip().split("\n")[0]
  assert not re.match(r"^(\.venv/|tff-privacy |python|make |import |from |\$ )", first), (
      f"label this block with its language: {first}")


def commands(code):
  """The simple commands of a shell block, as word lists, a loop's variable
  given its first value."""
  found = []
  for line in code.replace("\\\n", " ").replace("$i", "0").split("\n"):
    words = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    words.whitespace_split = True
    words.commenters = "#"
    command = []
    for word in [*words, ";"]:
      if word in (";", "&", "&&", "|", "||"):
        found.append(command)
        command = []
      elif command or word not in ("do", "done", "then", "fi"):
        command.append(word)
  return [c for c in found if c]


def test_commands_are_split_as_the_shell_splits_them():
  code = ("for i in 0 1; do tff-privacy attack --shard $i/2 \\\n"
          "    --quiet & done; wait  # all\nmake demo\n")
  assert commands(code) == [
      ["for", "i", "in", "0", "1"],
      ["tff-privacy", "attack", "--shard", "0/2", "--quiet"],
      ["wait"], ["make", "demo"]]


def make_targets():
  with open(os.path.join(ROOT, "Makefile")) as f:
    return set(re.findall(r"^([\w-]+):", f.read(), re.M))


# programs a shell block may name that the checks below do not know
SHELL_ONLY = {"for", "wait"}


def check_command(words):
  while words and (re.match(r"^\w+=", words[0]) or words[0] in ("time", "env")):
    words = words[1:]  # VAR=value, time, env: the command they run
  program = os.path.basename(words[0])
  if program == "tff-privacy":
    check_cli(words[1:])
  elif program.startswith("python") and words[1:2] != ["-c"]:
    script = words[2] if words[1] == "-m" else words[1]
    path = (os.path.join(ROOT, *script.split(".")) + ".py" if words[1] == "-m"
            else os.path.join(ROOT, script))
    assert os.path.isfile(path), f"no file {script}"
    with open(path) as f:
      text = f.read()
    flags = [w.split("=")[0] for w in words[2:] if w.startswith("--")]
    missing = [f for f in flags if f'"{f}"' not in text]
    assert not missing, f"{script} takes no {missing}"
    if script in RUN:
      subprocess.run([sys.executable, path, *words[2:]], check=True,
                     capture_output=True)
  elif program == "make":
    assert set(words[1:]) <= make_targets(), words
  elif program == "ssh":  # ssh [-N -L SPEC] HOST ['COMMAND']
    command = [w for w in words[1:] if not w.startswith("-") and ":" not in w][1:]
    for inner in commands(" ".join(command)):
      check_command(inner)
  else:
    assert program in SHELL_ONLY, f"{program}: no check for it; add one"


def check_cli(argv):
  """`tff-privacy` ARGV as the CLI checks it before it runs anything."""
  args = cli._parser().parse_args(argv)
  if args.command == "train":
    cli._config_from_args(args)
  elif args.command == "attack":
    cli._attack_flags().given(args, args.attack)
  elif args.command == "leaderboard" and args.entries:
    from tff_privacy import leaderboard
    grid = leaderboard.grid.parse(leaderboard.defaults.grid(args.scale))
    leaderboard.grid.only(grid, args.entries)


@pytest.mark.parametrize("language, code", blocks_of("sh"))
def test_shell_blocks_are_valid_commands(language, code, tmp_path, monkeypatch):
  syntax = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
  assert syntax.returncode == 0, syntax.stderr
  monkeypatch.chdir(tmp_path)  # relative paths a command reads, e.g. results/
  for words in commands(code):
    try:
      check_command(words)
    except SystemExit as e:  # argparse's answer to a wrong flag or value
      pytest.fail(f"{' '.join(words)}: exit {e.code}")


@pytest.mark.parametrize("language, code", blocks_of("json", "toml"))
def test_data_blocks_parse(language, code):
  if language == "json":
    json.loads(code)
    return
  groups = tomllib.loads(code).get("project", {}).get("entry-points", {})
  from tff_privacy import registry
  known = {r.group for r in (registry.METHODS, registry.DEFENSES, registry.ATTACKS)}
  assert set(groups) <= known, (set(groups), known)


def python_blocks(included):
  return [pytest.param(code, after, id=f"{page}:{line}",
                       marks=() if included else pytest.mark.slow)
          for page, line, language, code, after in BLOCKS
          if language == "python" and bool(SNIPPET.match(code.strip())) == included]


@pytest.mark.parametrize("code, after", python_blocks(included=True))
def test_included_files_are_run_by_a_test(code, after):
  path = SNIPPET.match(code.strip()).group(1)
  runner = INCLUDED.get(path)
  assert runner, f"{path} is included whole; name the test that runs it in INCLUDED"
  with open(os.path.join(ROOT, runner)) as f:
    assert os.path.basename(path) in f.read()


@pytest.mark.parametrize("code, after", python_blocks(included=False))
def test_python_blocks_run(code, after, tmp_path):
  script = tmp_path / "block.py"
  script.write_text(code)
  done = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  if after.startswith("prints "):  # what the page says it prints, it prints
    said = printed_claims(after)
    assert said, f"nothing in backticks after 'prints': {after[:80]}"
    for claim in said:
      assert printed(claim, done.stdout), (claim, done.stdout[-2000:])


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def printed_claims(paragraph):
  """The backticked strings of `paragraph` before its first colon outside
  backticks (what a block is said to print)."""
  quoted, claims, current = False, [], ""
  for char in paragraph[len("prints "):]:
    if char == "`":
      if quoted:
        claims.append(current)
      quoted, current = not quoted, ""
    elif quoted:
      current += char
    elif char == ":":
      break
  return claims


def printed(claim, output, tolerance=0.02):
  """Whether `output` holds `claim`, its numbers within `tolerance` (float
  results may round differently on another CPU)."""
  pattern = re.escape(claim)
  for number in NUMBER.findall(claim):
    pattern = pattern.replace(re.escape(number), r"(-?\d+(?:\.\d+)?)", 1)
  for match in re.finditer(pattern, output):
    found = [float(g) for g in match.groups()]
    if all(abs(f - float(n)) <= tolerance for f, n in zip(found, NUMBER.findall(claim))):
      return True
  return False


def test_printed_claims_are_read_and_matched_as_a_reader_would():
  after = "prints `ig SSIM 0.751` and `attacks: ig` (about 15 s): Soteria `x`"
  assert printed_claims(after) == ["ig SSIM 0.751", "attacks: ig"]
  assert printed("ig SSIM 0.751", "x\nig SSIM 0.76\n")
  assert not printed("ig SSIM 0.751", "ig SSIM 0.80")
  assert not printed("ig SSIM 0.751", "ig_masked SSIM 0.751")


def table(page, heading):
  """The rows of the first table after `heading` in docs/`page`, as lists
  of cells without their code marks."""
  with open(os.path.join(ROOT, "docs", page)) as f:
    text = f.read()
  rows = []
  for line in text[text.index(heading):].split("\n")[1:]:
    if line.startswith("|"):
      rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    elif rows:
      break
  return rows[2:]  # past the header and its rule


def test_the_threat_models_tables_are_the_registries():
  from tff_privacy import attacks
  from tff_privacy.registry import ATTACKS
  declared = {a: getattr(ATTACKS.lookup(a), "READS", None) or "nothing"
              for a in ATTACKS}
  rows = table("threat-model.md", "## What a defense discloses")
  assert {r[0]: r[1] for r in rows} == declared
  answered = {a: sorted(d for d in attacks.defenses() if a in attacks.adaptive_attacks(d))
              for a, reads in declared.items() if reads != "nothing"}
  assert {r[0]: sorted(c.strip().strip("`") for c in r[2].split(","))
          for r in rows if r[0] in answered} == answered
  unanswered = table("threat-model.md", "The defenses that declare nothing")
  assert {r[0]: r[1] for r in unanswered} == attacks.without_adaptive_attack()


def test_the_relations_table_is_the_mechanisms_own():
  from tff_privacy.algorithms import fedre
  from tff_privacy.audit.clients import TRAINING_RELATION
  from tff_privacy.defenses.central import DPFedAvg
  from tff_privacy.defenses.updates import LOCAL_RELATION
  from tff_privacy.dp import dp_sgd
  dp_fedavg = DPFedAvg(clip=1.0, noise_multiplier=1.0)
  relations = [LOCAL_RELATION, dp_fedavg.round_event(200, 200).relation,
               dp_fedavg.round_event(200, 16).relation, dp_sgd.RELATION,
               fedre.SAMPLE_RELATION, TRAINING_RELATION]
  cells = [row[1] for row in table("privacy/dp-accounting.md", "An epsilon means")]
  assert len(cells) == len(relations)
  for cell, relation in zip(cells, relations):
    assert relation.startswith(cell), (cell, relation)
