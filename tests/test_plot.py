"""dspine/utils/plot.py: pyplot when matplotlib is there (Agg, file-only), None and a hint when not;
save_figure writes the file and closes the figure."""

import sys

import pytest

from dspine.utils.plot import pyplot, save_figure


def test_without_matplotlib_there_is_no_plot_and_a_hint(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    assert pyplot("run --report-only later") is None
    assert "matplotlib missing: no plot; run --report-only later" in capsys.readouterr().out


def test_save_figure_writes_and_closes(tmp_path):
    plt = pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed")
    assert plt.get_backend().lower() == "agg"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "x.png")
    assert path.stat().st_size > 1000 and not plt.fignum_exists(fig.number)
