"""``subquad compare --peers``: peer packages side by side (the ``peers`` extra)."""

import json

import pytest

import subquad
from subquad import cli
from subquad.compare import peers
from subquad.compare.compare import Config

ALL = [m.name for m in subquad.list_methods()]


def tiny(**kw):
    return Config(**{**dict(ns=[128], batch=1, heads=2, dim=16, methods=ALL, min_run_time=0.001), **kw})


def test_missing_peers_are_skipped_with_a_note(monkeypatch):
    monkeypatch.setattr(peers.Peer, "installed", lambda self: False)
    res = peers.run(tiny(), show_progress=False)
    assert res["rows"] == []
    assert len(res["notes"]) == len(peers.PEERS)
    assert all("not installed" in n for n in res["notes"])


def test_nystrom_peer_matches_subquad_on_the_same_inputs():
    pytest.importorskip("nystrom_attention")
    pytest.importorskip("einops")
    res = peers.run(tiny(options={"nystrom": {"num_landmarks": 8}}), show_progress=False)
    row = next(r for r in res["rows"] if r["peer"] == "nystrom-attention")
    assert row.get("error") is None, row
    # the same algorithm with the same settings (N a multiple of the landmarks): the same output
    assert row["err_ours"] == pytest.approx(row["err_peer"], rel=1e-4)
    assert row["t_ours"] > 0 and row["t_peer"] > 0 and row["speedup"] > 0
    assert row["settings"].startswith("8 landmarks")


@pytest.mark.parametrize("module, method", [("performer_pytorch", "performer"),
                                            ("sinkhorn_transformer", "sinkhorn"),
                                            ("hamburger_pytorch", "hamburger")])
def test_other_peers_run(module, method):
    pytest.importorskip(module)
    if method not in ALL:
        pytest.skip(f"subquad has no {method}")
    res = peers.run(tiny(methods=["softmax", method]), show_progress=False)
    (row,) = res["rows"]
    assert row.get("error") is None, row
    assert row["t_ours"] > 0 and row["t_peer"] > 0
    if method == "hamburger":
        assert row["err_ours"] is None and row["err_peer"] is None
    else:
        assert 0 < row["err_ours"] < 100 and 0 < row["err_peer"] < 100


def test_cli_writes_the_peers_report(capsys, tmp_path):
    pytest.importorskip("nystrom_attention")
    pytest.importorskip("einops")
    out_dir = tmp_path / "peers"
    code = cli.main(["compare", "--peers", "--n", "64", "--heads", "2", "--dim", "16", "--methods", "nystrom",
                     "--option", "nystrom.num_landmarks=8", "--min-run-time", "0.001", "--quiet",
                     "--out", str(out_dir)])
    assert code == 0
    for name in ("results.json", "report.md", "peers.png"):
        assert (out_dir / name).stat().st_size > 0
    res = json.loads((out_dir / "results.json").read_text())
    assert res["kind"] == "peers" and [r["peer"] for r in res["rows"]] == ["nystrom-attention"]
    assert "nystrom-attention" in capsys.readouterr().out
