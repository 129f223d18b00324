"""What the fault tests share: a tiny token file and the flags of a tiny run."""

from __future__ import annotations

import pytest

from engine.training.data import prepare

TINY = ["--model", "gpt-tiny", "--global-batch", "4", "--seq-len", "16", "--micro-batches", "2",
        "--threads", "1", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="package")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "text.txt").write_text("faults are injected and survived\n" * 200)
    return str(prepare(folder / "text.txt", folder / "tokens").bin_path)
