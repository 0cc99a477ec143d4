"""train/console.py: a library warning said as one line by the command lines."""

import sys
import warnings

from train.console import warnings_as_lines


def test_a_warning_is_one_line_and_python_s_display_comes_back_after(capsys):
    shown, filters = warnings.showwarning, list(warnings.filters)
    with warnings_as_lines():
        warnings.simplefilter("always")
        warnings.warn("the heads were trained on another base", UserWarning, stacklevel=1)
        warnings.warn("and a second one", DeprecationWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert err == "warning: the heads were trained on another base\nwarning: and a second one\n"
    assert warnings.showwarning is shown and warnings.filters == filters


def test_a_warning_passed_to_a_file_goes_there(tmp_path, capsys):
    with warnings_as_lines(), open(tmp_path / "log", "w") as log:
        warnings.showwarning("to the log", UserWarning, "x.py", 1, file=log)
    assert (tmp_path / "log").read_text() == "warning: to the log\n"
    assert capsys.readouterr().err == ""


def test_no_stderr_or_a_closed_one_is_no_error(monkeypatch, capsys):
    """`pythonw` has no stderr: nothing is said (not on stdout either); a closed pipe does not
    turn a warning into a crash."""
    with warnings_as_lines():
        warnings.simplefilter("always")
        monkeypatch.setattr(sys, "stderr", None)
        warnings.warn("nowhere to say it", UserWarning, stacklevel=1)

        class Closed:
            def write(self, text):
                raise BrokenPipeError(32, "Broken pipe")

        monkeypatch.setattr(sys, "stderr", Closed())
        warnings.warn("a closed pipe", UserWarning, stacklevel=1)
    assert capsys.readouterr().out == ""
