"""The recommendation logic of subquad compare, as pure functions on result rows."""

import itertools

import pytest

from subquad.compare.recommend import budget_table, pareto_front, recommend


def row(method, n, t, err, t_train=None):
    return {"method": method, "n": n, "forward_s": t, "forward_backward_s": t_train, "rel_error": err}


ROWS = [
    row("softmax", 1024, 0.100, 3e-7, 0.30),
    row("nystrom", 1024, 0.020, 0.40, 0.05),
    row("linear", 1024, 0.005, 0.80, 0.02),
    row("performer", 1024, 0.030, 0.90, 0.10),  # slower and worse than nystrom: never chosen
    row("softmax", 4096, 1.600, 3e-7, 4.00),
    row("nystrom", 4096, 0.080, 0.50, 0.20),
    {"method": "hamburger", "n": 1024, "forward_s": 0.001, "forward_backward_s": 0.002, "rel_error": None},
    {"method": "ra", "n": 1024, "forward_s": None, "forward_backward_s": None, "rel_error": None},  # failed
]


def test_fastest_method_within_the_budget():
    assert recommend(ROWS, 1024, 0.5)["method"] == "nystrom"
    assert recommend(ROWS, 1024, 0.85)["method"] == "linear"
    assert recommend(ROWS, 1024, 0.8)["method"] == "linear"  # the budget is inclusive
    assert recommend(ROWS, 1024, 0.1)["method"] == "softmax"


def test_uses_the_requested_length_only():
    assert recommend(ROWS, 4096, 0.45)["method"] == "softmax"
    assert recommend(ROWS, 4096, 0.6)["method"] == "nystrom"
    assert recommend(ROWS, 2048, 1.0) is None


def test_no_method_within_the_budget():
    assert recommend(ROWS, 1024, 1e-9) is None


def test_rows_without_an_error_or_a_time_are_never_chosen():
    # the mixer is fastest and the failed row has no time: neither may be recommended
    assert recommend(ROWS, 1024, 10.0)["method"] == "linear"


def test_training_objective_uses_forward_backward_time():
    rows = [row("a", 8, 0.01, 0.1, t_train=0.50), row("b", 8, 0.02, 0.1, t_train=0.10)]
    assert recommend(rows, 8, 0.2, "forward")["method"] == "a"
    assert recommend(rows, 8, 0.2, "training")["method"] == "b"


def test_ties_go_to_the_smaller_error():
    rows = [row("a", 8, 0.01, 0.3), row("b", 8, 0.01, 0.2)]
    assert recommend(rows, 8, 0.5)["method"] == "b"


def test_unknown_objective_raises():
    with pytest.raises(KeyError):
        recommend(ROWS, 1024, 0.5, "latency")


def test_budget_table_is_the_pareto_front_fastest_first():
    table = budget_table(ROWS, 1024)
    assert [e["row"]["method"] for e in table] == ["linear", "nystrom", "softmax"]
    assert table[0]["to_error"] is None
    assert [e["to_error"] for e in table[1:]] == [0.80, 0.40]


@pytest.mark.parametrize("budget", [1e-8, 3e-7, 0.1, 0.39, 0.4, 0.41, 0.79, 0.8, 0.81, 5.0])
def test_budget_table_agrees_with_recommend(budget):
    table = budget_table(ROWS, 1024)
    inside = [e for e in table
              if e["from_error"] <= budget and (e["to_error"] is None or budget < e["to_error"])]
    best = recommend(ROWS, 1024, budget)
    if best is None:
        assert inside == []
    else:
        assert [e["row"]["method"] for e in inside] == [best["method"]]


def test_pareto_front():
    points = [(3.0, 0.1), (1.0, 0.9), (2.0, 0.5), (2.5, 0.6), (1.5, 0.95)]
    assert pareto_front(points) == [(1.0, 0.9), (2.0, 0.5), (3.0, 0.1)]
    front = pareto_front(points)
    for (t1, e1), (t2, e2) in itertools.combinations(front, 2):
        assert t1 < t2 and e1 > e2
