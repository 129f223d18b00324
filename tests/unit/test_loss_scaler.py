"""fp16's loss scaler follows DeepSpeed's: the same scales and skipped steps as
`deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler` on the same overflow pattern."""

from __future__ import annotations

import types
from typing import Any

import pytest

from engine.config import EngineOptions
from engine.runtime.precision import LossScaler

OK, INF = True, False
PATTERNS = {
    "growth only": [OK] * 9,
    "one overflow absorbed by hysteresis": [OK, OK, INF, OK, OK, OK, OK, OK],
    "two overflows in a row halve once": [OK, INF, INF, OK, OK, OK, OK, OK, OK],
    "scattered overflows": [INF, OK, INF, OK, OK, INF, INF, INF, OK, OK, OK, OK, INF, OK],
    "down to the minimum and beyond": [INF] * 12 + [OK] * 5,
}


def _deepspeed_scaler(monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any]) -> Any:
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    return loss_scaler.DynamicLossScaler(
        init_scale=2.0 ** settings["initial_scale_power"],
        scale_window=settings["loss_scale_window"],
        min_scale=settings["min_loss_scale"],
        delayed_shift=settings["hysteresis"],
        consecutive_hysteresis=settings["consecutive_hysteresis"],
        raise_error_at_min_scale=False,
    )


def _scales(update: Any, scale: Any, pattern: list[bool]) -> list[float]:
    """The scale each step of `pattern` runs at, after updating for the one before."""
    scales = []
    for finite in pattern:
        scales.append(float(scale()))
        update(finite)
    return scales


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_the_scale_sequence_is_deepspeeds(
    monkeypatch: pytest.MonkeyPatch, name: str, hysteresis: int, consecutive: bool
) -> None:
    settings = {
        "initial_scale_power": 4, "loss_scale_window": 2, "min_loss_scale": 1.0,
        "hysteresis": hysteresis, "consecutive_hysteresis": consecutive,
    }  # fmt: skip
    theirs = _deepspeed_scaler(monkeypatch, settings)
    ours = LossScaler.of(EngineOptions(precision="fp16", **settings))
    assert ours is not None
    pattern = PATTERNS[name]
    expected = _scales(lambda ok: theirs.update_scale(not ok), lambda: theirs.cur_scale, pattern)
    assert _scales(ours.update, lambda: ours.scale, pattern) == expected


def test_the_scale_stops_at_the_minimum() -> None:
    scaler = LossScaler.of(EngineOptions(precision="fp16", initial_scale_power=3, min_loss_scale=2))
    assert scaler is not None
    assert _scales(scaler.update, lambda: scaler.scale, [INF] * 5) == [8, 4, 2, 2, 2]


def test_a_static_scale_never_moves() -> None:
    scaler = LossScaler.of(EngineOptions(precision="fp16", loss_scale=128, loss_scale_window=1))
    assert scaler is not None
    assert _scales(scaler.update, lambda: scaler.scale, [OK, INF, OK, OK]) == [128] * 4


def test_no_scaler_outside_fp16() -> None:
    assert LossScaler.of(EngineOptions(precision="bf16")) is None


def test_a_resumed_scaler_continues_exactly() -> None:
    options = EngineOptions(precision="fp16", loss_scale_window=3, hysteresis=2)
    pattern = [OK, INF, OK, OK, INF, OK, OK, OK, OK, INF, INF, OK, OK, OK, OK]
    whole = LossScaler.of(options)
    first, resumed = LossScaler.of(options), LossScaler.of(options)
    assert whole is not None and first is not None and resumed is not None
    expected = _scales(whole.update, lambda: whole.scale, pattern)
    head = _scales(first.update, lambda: first.scale, pattern[:5])
    resumed.load_state_dict(first.state_dict())
    assert head + _scales(resumed.update, lambda: resumed.scale, pattern[5:]) == expected
    assert resumed.state_dict()["hysteresis_left"] == whole.state_dict()["hysteresis_left"]


def test_loss_scale_settings_outside_fp16_are_refused_by_flag() -> None:
    with pytest.raises(ValueError, match="--hysteresis only apply to --precision fp16"):
        EngineOptions(precision="bf16", hysteresis=2)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"loss_scale": -1.0}, "loss_scale=-1.0"),
        ({"loss_scale_window": 0}, "loss_scale_window=0 must be at least 1"),
        ({"hysteresis": 0}, "hysteresis=0 must be at least 1"),
        ({"min_loss_scale": 0.0}, "min_loss_scale=0.0 must be > 0"),
    ],
)
def test_a_bad_loss_scale_setting_is_refused_by_name(setting: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineOptions(precision="fp16", **setting)


def test_a_scale_saved_before_hysteresis_existed_still_loads() -> None:
    scaler = LossScaler(window=3)
    scaler.load_state_dict({"scale": 1024.0, "good_steps": 2})
    assert _scales(scaler.update, lambda: scaler.scale, [OK, OK]) == [1024, 1024]
    assert scaler.scale == 2048
