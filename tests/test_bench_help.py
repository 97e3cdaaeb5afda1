"""``python -m deepep_cupy.bench --help``: every option has a help text that ends in its real
default, written once, as it is typed on the command line."""

import argparse
import re

import pytest

from deepep_cupy.bench import cli

PARSER = cli.build_parser()
#: Every option but --help.
OPTIONS = [a for a in PARSER._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
FLAGS = [a for a in OPTIONS if a.nargs == 0]
VALUED = [a for a in OPTIONS if a.nargs != 0]


def _help_of(action: argparse.Action) -> str:
    """The option's entry as --help prints it (option, metavar, help), joined into one line."""
    lines = PARSER.format_help().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {action.option_strings[0]}"))
    entry = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("   "):  # the next option ("  --x"), a blank line or a group's title
            break
        entry.append(line)
    return " ".join(" ".join(entry).split())


def _name(action: argparse.Action) -> str:
    return action.option_strings[0]


@pytest.mark.parametrize("action", OPTIONS, ids=_name)
def test_every_option_has_a_help_text(action):
    assert action.help and action.help.strip(), _name(action)


@pytest.mark.parametrize("action", OPTIONS, ids=_name)
def test_no_option_states_its_default_twice(action):
    assert _help_of(action).count("default") <= 1, _help_of(action)


@pytest.mark.parametrize("action", VALUED, ids=_name)
def test_every_option_with_a_value_states_its_default(action):
    assert "(default: " in _help_of(action), _help_of(action)


@pytest.mark.parametrize("action", FLAGS, ids=_name)
def test_an_on_off_flag_states_no_stored_value_as_its_default(action):
    # --no-check stores False when given: "(default: True)" beside it reads as "checks off by default".
    assert "(default: " not in _help_of(action), _help_of(action)


@pytest.mark.parametrize("option, default", [
    ("--num-tokens", "(default: 4096)"),
    ("--tune-sms", "(default: 8,16,24,32,48)"),
    ("--calls-libs", "(default: cupy,torch)"),
    ("--tokens-sweep", "(default: no sweep; with --plot: 512,1024,2048,4096,8192)"),
    ("--decode-tokens", "(default: 1,32,64,128,256)"),
    ("--json", "(default: not written)"),
])
def test_a_default_is_shown_as_it_is_typed(option, default):
    action = next(a for a in OPTIONS if option in a.option_strings)
    assert _help_of(action).endswith(default), _help_of(action)


@pytest.mark.parametrize("action", [a for a in VALUED if a.default is not None], ids=_name)
def test_the_default_shown_is_the_one_the_parser_uses(action):
    shown = re.search(r"\(default: ([^)]*)\)$", _help_of(action))
    if shown is None:  # said in words ("the recommended config"), not a value
        pytest.skip(f"{_name(action)} says its default in words")
    assert shown.group(1) == cli._shown(action.default), _help_of(action)
