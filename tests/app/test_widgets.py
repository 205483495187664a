"""A number typed in a box is read, or refused in words that name the box, what was typed and what it takes."""

from __future__ import annotations

import pytest

from meshpact.app.widgets import read_number


@pytest.mark.parametrize(
    "typed, said",
    [
        ("0.2", "**days**: 0.2 is not a whole number; expected a whole number from 1 to 365."),
        ("400", "**days**: 400 is more than it takes; expected a whole number from 1 to 365."),
        ("0", "**days**: 0 is less than it takes; expected a whole number from 1 to 365."),
        ("seven", "**days**: 'seven' is not a number; expected a whole number from 1 to 365."),
        ("nan", "**days**: 'nan' is not a finite number; expected a whole number from 1 to 365."),
        ("  ", "**days** is empty: type a whole number from 1 to 365."),
    ],
)
def test_a_number_the_box_does_not_take_is_refused_in_words(typed, said):
    assert read_number(typed, "days", 1, 365, whole=True) == (None, said)


def test_a_number_the_box_takes_is_read_as_typed():
    assert read_number("7", "days", 1, 365, whole=True) == (7, None)
    assert read_number("1,024", "ranks", 2, 16_384, whole=True) == (1024, None)
    assert read_number(" 7.0 ", "days", 1, 365, whole=True) == (7, None)
    assert read_number("0.25", "days", 0.1, 365) == (0.25, None)
    value, problem = read_number("1e9", "MTBF", 1, 1e6)
    assert value is None and "1,000,000,000 is more than it takes" in problem and "to 1,000,000" in problem
