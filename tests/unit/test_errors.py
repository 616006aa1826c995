"""The error hierarchy: stable codes, one-line messages, rebuilt from the wire by code."""

import pytest

from fedhive import errors


def _all_error_types() -> list[type[errors.FedhiveError]]:
    found, todo = [], [errors.FedhiveError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def _code_owners() -> list[type[errors.FedhiveError]]:
    """Classes that define their own code. A subclass that inherits its code (such as a job's
    `Violations`) travels on the wire as the ancestor that defines it."""
    return [cls for cls in _all_error_types() if "code" in vars(cls)]


def test_codes_are_unique() -> None:
    codes = [cls.code for cls in _code_owners()]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("cls", _code_owners(), ids=lambda c: c.__name__)
def test_round_trip_by_code(cls: type[errors.FedhiveError]) -> None:
    original = cls("job 'j1': bad\n  field", field="deploy_map")
    rebuilt = errors.from_code(original.code, original.message, original.field)
    assert type(rebuilt) is cls
    assert str(rebuilt) == "job 'j1': bad field"
    assert rebuilt.field == "deploy_map"


def test_unknown_code_becomes_root_error() -> None:
    rebuilt = errors.from_code("FROM_THE_FUTURE", "something new", "")
    assert type(rebuilt) is errors.FedhiveError
    assert rebuilt.field is None
