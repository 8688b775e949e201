"""When the statements of an acquire are given up: pure arithmetic, no database."""

from __future__ import annotations

import math

from django_dlock.retry import Deadline
from django_dlock.strategies.connection import STATEMENT_FLOOR, watch_end


def test_statements_are_given_up_at_the_deadline():
    deadline = Deadline(3)
    assert watch_end(deadline, deadline.start) == deadline.end


def test_a_try_once_still_gets_one_round_trip():
    deadline = Deadline(0)
    assert watch_end(deadline, deadline.start) == deadline.start + STATEMENT_FLOOR


def test_the_floor_counts_from_the_start_not_from_each_statement():
    deadline = Deadline(1)
    # a statement sent 0.1 s before the deadline shares the acquire's end
    assert watch_end(deadline, deadline.start) == deadline.end
    assert watch_end(deadline, deadline.start) < deadline.end - 0.1 + STATEMENT_FLOOR


def test_no_timeout_is_never_given_up():
    assert Deadline(None).end == math.inf
    assert Deadline(math.inf).timeout is None
