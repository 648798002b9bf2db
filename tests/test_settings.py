"""The decode loop's named settings (`runtime.settings`): every entry point starts from `Runner`'s defaults."""

import argparse
import dataclasses
import inspect

import pytest

from blockpilot.commands import common
from blockpilot.predictor.labelling import LabelJob
from blockpilot.profiling.session import ProfileOptions
from blockpilot.runtime.runner import Runner


@pytest.mark.parametrize("setting, add_arg, profile_field, label_field", [
    ("lookup", common.add_lookup_arg, "lookups", "lookup"),
    ("verify_length", common.add_verify_length_arg, "verify_lengths", None),
])
def test_every_entry_point_defaults_to_the_runners_setting(setting, add_arg, profile_field, label_field):
    """`generate`/`demo`/`serve` (one value), `profile` (a list), `ProfileOptions` and, where it has the setting,
    `label` start from the value `Runner` starts from, so a request decodes alike whichever of them made it."""
    runner_default = inspect.signature(Runner.__init__).parameters[setting].default
    one, many = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_arg(one)
    add_arg(many, many=True)
    assert getattr(one.parse_args([]), setting) == runner_default
    assert getattr(many.parse_args([]), setting) == [runner_default]
    assert [f.default_factory() for f in dataclasses.fields(ProfileOptions)
            if f.name == profile_field] == [[runner_default]]
    if label_field is not None:
        assert [f.default for f in dataclasses.fields(LabelJob) if f.name == label_field] == [runner_default]


def test_lookup_lists_drop_repeats_and_keep_their_order():
    assert common.parse_lookups("off, greedy,off") == ["off", "greedy"]
