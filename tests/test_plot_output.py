"""``--plot`` of ``kvtier replay`` and ``kvtier soak``: the path is checked before
the run, a path without a suffix gets ``.png`` (and is the one printed), and the
file is written atomically in the format its suffix names (kvtier.replay.plot)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.replay.plot import PlotError, pyplot, save_figure

TRACE_LINES = [
    '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}',
    '{"timestamp": 5, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 3]}',
]
SOAK = ["soak", "--requests", "100", "--cpu-blocks", "64", "--disk-blocks", "128",
        "--no-redis", "--kinds", "chat", "--sample-every", "50", "--no-progress"]
"""A soak of a fraction of a second."""


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(TRACE_LINES) + "\n", encoding="utf-8")
    return path


def _replay(capsys: pytest.CaptureFixture[str], trace: Path,
            plot: str) -> tuple[int, str, str]:
    code = main(["replay", str(trace), "--capacity", "2,4", "--policy", "lru",
                 "--no-progress", "--plot", plot])
    out, err = capsys.readouterr()
    return code, out, err


def _bad_paths(tmp_path: Path) -> list[tuple[str, str]]:
    (tmp_path / "plots").mkdir()
    (tmp_path / "taken.png").mkdir()
    return [
        (str(tmp_path / "out.txt"), "matplotlib cannot write '.txt' files; use one of"),
        (str(tmp_path / "plots") + "/", "names a directory, not a file"),
        (str(tmp_path / "plots"), "names a directory, not a file"),
        (str(tmp_path / "taken"), f"{tmp_path / 'taken.png'} is a directory"),
        (str(tmp_path / "absent" / "x.png"),
         f"cannot write plot {tmp_path / 'absent' / 'x.png'}: no directory"),
    ]


def test_replay_checks_the_plot_path_before_the_run(capsys: pytest.CaptureFixture[str],
                                                    trace: Path, tmp_path: Path) -> None:
    # these used to be found after the whole run (a matplotlib traceback for .txt),
    # or wrote plots.png next to plots/
    for plot, message in _bad_paths(tmp_path):
        code, out, err = _replay(capsys, trace, plot)
        assert (code, out) == (2, ""), plot  # no table: nothing ran
        assert err.startswith("kvtier: error: ") and message in err, (plot, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots", "t.jsonl", "taken.png"]
    assert list((tmp_path / "plots").iterdir()) == []


def test_replay_plot_without_suffix_is_a_png_and_says_so(capsys: pytest.CaptureFixture[str],
                                                         trace: Path, tmp_path: Path) -> None:
    code, _, err = _replay(capsys, trace, str(tmp_path / "out"))
    assert code == 0
    assert err.strip() == f"kvtier: wrote plot {tmp_path / 'out.png'}"
    assert (tmp_path / "out.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "out").exists()


def test_replay_plot_format_follows_the_suffix(capsys: pytest.CaptureFixture[str],
                                              trace: Path, tmp_path: Path) -> None:
    code, _, err = _replay(capsys, trace, str(tmp_path / "out.SVG"))
    assert code == 0 and err.strip() == f"kvtier: wrote plot {tmp_path / 'out.SVG'}"
    assert b"<svg" in (tmp_path / "out.SVG").read_bytes()[:2000]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.SVG", "t.jsonl"]


def test_soak_checks_the_plot_path_before_the_run(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    for plot, message in _bad_paths(tmp_path):
        assert main([*SOAK, "--plot", plot]) == 2, plot
        out, err = capsys.readouterr()
        assert out == "" and message in err, (plot, err)


def test_soak_plot_without_suffix_is_a_png_and_says_so(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    assert main([*SOAK, "--json", "--plot", str(tmp_path / "soak")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"kvtier: wrote plot {tmp_path / 'soak.png'}"
    assert (tmp_path / "soak.png").read_bytes().startswith(b"\x89PNG")


def test_plot_path_rejects_pgf_without_its_tex(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    from kvtier.replay.plot import plot_path

    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(PlotError, match=r"matplotlib writes \.pgf files with"):
        plot_path(tmp_path / "out.pgf")
    assert plot_path(tmp_path / "out.pdf") == tmp_path / "out.pdf"


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "plot.png"
    target.write_bytes(b"the previous plot")
    plt = pyplot()
    fig, _ = plt.subplots()

    def half_written(fname: Any, **kwargs: Any) -> None:
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    fig.savefig = half_written
    try:
        with pytest.raises(PlotError, match=r"cannot write plot .*No space left on device"):
            save_figure(fig, target)
    finally:
        plt.close(fig)
    assert target.read_bytes() == b"the previous plot"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_save_figure_replaces_the_file_in_the_suffix_format(tmp_path: Path) -> None:
    target = tmp_path / "plot.pdf"
    target.write_bytes(b"old")
    plt = pyplot()
    fig, _ = plt.subplots()
    try:
        save_figure(fig, target)
    finally:
        plt.close(fig)
    assert target.read_bytes().startswith(b"%PDF")
    assert [p.name for p in tmp_path.iterdir()] == ["plot.pdf"]
