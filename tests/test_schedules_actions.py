import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipedream_ft.schedules import Action, Kind, compute_only, parse_action

pytestmark = pytest.mark.timeout(60)

actions = st.builds(Action, stage=st.integers(0, 10**6), kind=st.sampled_from(list(Kind)),
                    index=st.integers(0, 10**6))


def test_prints_compactly():
    assert [str(a) for a in (Action(2, Kind.F, 5), Action(1, Kind.I, 0), Action(0, Kind.W, 3),
                             Action(1, Kind.SEND_F, 2), Action(3, Kind.RECV_B, 11), Action(0, Kind.U, 7),
                             Action(12, Kind.B, 0))] == [
        "2F5", "1I0", "0W3", "1SEND_F2", "3RECV_B11", "0U7", "12B0"]
    assert repr([Action(0, "F", 1)]) == "[0F1]"


def test_parses_back():
    assert parse_action("2F5") == Action(2, Kind.F, 5)
    assert parse_action(" 10SEND_B3 ") == Action(10, Kind.SEND_B, 3)
    assert parse_action("1RECV_F20") == Action(1, Kind.RECV_F, 20)
    assert Action.parse("0U1") == Action(0, Kind.U, 1)


@given(actions)
def test_round_trip(a):
    assert parse_action(str(a)) == a
    assert parse_action(str(a)).kind is a.kind


@pytest.mark.parametrize("text", ["", "F5", "2F", "2X5", "2f5", "-1F0", "2F5x", "2 F5", "2SEND5", "1F1B"])
def test_bad_text_is_named(text):
    with pytest.raises(ValueError, match=f"bad action {text!r}"):
        parse_action(text)


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="unknown action kind 'Q'"):
        Action(0, "Q", 1)
    with pytest.raises(ValueError, match="action stage must be an integer >= 0, got -1"):
        Action(-1, Kind.F, 0)
    with pytest.raises(ValueError, match="action index must be an integer >= 0, got 1.5"):
        Action(0, Kind.F, 1.5)
    with pytest.raises(ValueError, match="an action is a string"):
        parse_action(3)


def test_actions_are_values():
    assert Action(1, "F", 2) == Action(1, Kind.F, 2)
    assert len({Action(1, Kind.F, 2), Action(1, "F", 2), Action(1, Kind.B, 2)}) == 2


def test_compute_only_drops_idle_updates_and_messages():
    s = {1: [None, Action(1, Kind.RECV_F, 0), Action(1, Kind.F, 0), Action(1, Kind.U, 0)],
         0: [Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0), Action(0, Kind.W, 0)]}
    assert compute_only(s) == {0: [Action(0, Kind.F, 0), Action(0, Kind.W, 0)], 1: [Action(1, Kind.F, 0)]}
