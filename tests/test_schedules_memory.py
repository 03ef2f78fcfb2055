import pytest

from pipedream_ft.schedules import Action, Kind, build, gpipe, one_f_one_b, peak_in_flight, pipedream, zb_h1

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("ranks,n", [(1, 1), (2, 5), (4, 8), (4, 3), (5, 10)])
def test_straight_peaks(ranks, n):
    assert peak_in_flight(gpipe(ranks, n)) == {s: n for s in range(ranks)}
    assert peak_in_flight(one_f_one_b(ranks, n)) == {s: min(ranks - s, n) for s in range(ranks)}
    assert peak_in_flight(pipedream(ranks, n)) == {s: min(ranks - s, n) for s in range(ranks)}
    # ZB-H1's deferred W keep their activations: rank r holds its 1F1B depth plus the r weight gradients it owes
    assert peak_in_flight(zb_h1(ranks, n)) == {s: min(ranks, n) for s in range(ranks)}


def test_v_peaks_and_idle_slots():
    assert peak_in_flight(build("zbv", 2, 4).schedule) == {0: 4, 1: 3, 2: 2, 3: 1}
    f, b = Kind.F, Kind.B
    assert peak_in_flight({0: [Action(0, f, 0), None, Action(0, b, 0), Action(0, f, 1), Action(0, b, 1)]}) == {0: 1}
