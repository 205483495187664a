"""The data-path timeout follows what the job's steps take, or a shorter one is refused in one line."""

from __future__ import annotations

import pytest

from meshpact.live.recovery.config import RecoveryConfig, TimeoutOrderError


def test_a_timeout_shorter_than_the_steps_follows_them_and_one_long_enough_is_kept():
    cfg = RecoveryConfig(data_timeout_s=1.0)
    fitted = cfg.fit(longest_step_s=12.8)  # a 110 M-parameter step on 4 gloo ranks of a loaded 2-core host
    assert fitted.data_timeout_s == pytest.approx(4 * 12.8) and fitted.detection_bound_s == cfg.heartbeat_detect_s
    assert cfg.fit(longest_step_s=0.1) is cfg  # the tiny decoder's steps: 1 s covers them


def test_a_fixed_timeout_shorter_than_the_steps_is_refused_naming_both_values():
    cfg = RecoveryConfig(data_timeout_s=1.0, data_timeout_follows=False, data_timeout_margin=2.0)
    with pytest.raises(TimeoutOrderError) as info:
        cfg.fit(longest_step_s=3.0)
    assert "\n" not in str(info.value) and "(1 s)" in str(info.value) and "3 s = 6 s" in str(info.value)
    with pytest.raises(TimeoutOrderError, match="data_timeout_margin must be at least 1"):
        RecoveryConfig(data_timeout_margin=0.5)
