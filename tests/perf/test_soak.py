"""The soak's memory figures: the slope per role is the least-squares line after the first 3 minutes."""
import math

from perf.soak import growth, slope

MIB = 2 ** 20


def test_the_slope_is_the_least_squares_line_after_minute_3():
    # a role climbing 2 MiB per minute after a start-up spike in the first 3 minutes (left out of the fit)
    samples = [(t, {"keeper": (500 if t < 180 else 100 + 2 * t / 60) * MIB, "ranks": 800 * MIB})
               for t in range(0, 600, 10)]
    assert math.isclose(slope(samples, "keeper"), 2.0, rel_tol=1e-9)
    assert slope(samples, "ranks") == 0.0
    assert math.isclose(growth(samples, "ranks"), 0.0, abs_tol=1e-9)


def test_a_role_with_too_few_samples_after_minute_3_has_no_slope():
    samples = [(t, {"muxer": 100 * MIB}) for t in range(0, 250, 10)]      # 7 samples at or after 180 s
    assert math.isnan(slope(samples, "muxer"))
    assert math.isnan(slope(samples, "absent"))
