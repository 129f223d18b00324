"""The CLI's failure path, as the tests of its error messages read it."""

from __future__ import annotations

import pytest

from engine.cli.main import main

__all__ = ["cli_error"]


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run `meshpipe ARGV`, which must exit without a traceback: its exit code and stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return int(exit_info.value.code or 0), err
