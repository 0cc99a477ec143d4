"""How the command lines (scripts/*.py, train/medusa.py, train/eagle.py) say a library warning: as
one `warning: MESSAGE` line on stderr. Python's own format adds the file, line and source line
that raised it (`heads/config.py:132: UserWarning: ...` and then `  warnings.warn(`), which tell
a user of a command line nothing and break a chat's or a progress bar's lines in two."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress


@contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Within it, each warning shown prints as one line on stderr (which ones are shown, once
    per place by default, stays Python's and the user's `-W` / PYTHONWARNINGS choice)."""
    with warnings.catch_warnings():  # restores the filters and showwarning on the way out
        warnings.showwarning = _say
        yield


def _say(message, category, filename, lineno, file=None, line=None) -> None:
    file = sys.stderr if file is None else file
    if file is None:  # no stderr (pythonw): said nowhere, as Python's own display does
        return
    with suppress(OSError):  # a closed pipe (`chat.py 2>&1 | head`): not worth a crash
        print(f"warning: {message}", file=file)
